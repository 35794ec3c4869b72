"""The tabular loader benchmark: rows/s through read + decode + hash + transform + batch with
our loader, against what users write by hand on the same rows, alternated in one run; and
feature hashing's values per second on one core.

    result, table = run(args)   # args: batch_size, repeats, threads, work (a folder), rows,
                                # epochs; optional source (your TSV/CSV file instead of ours)

Contenders (the same work: 13 dense counts log1p'd, 26 categorical fields hashed into 2^18
ids with the same hash, labels, batches of `batch_size` rows as tensors):
- shardflow: `tabular_loader(shards, ...)` with its row shuffle, one pass;
- plain loop: the source TSV read with the `csv` module, each row parsed, each value hashed in
  plain Python (`hashing.bucket_id`), batches stacked with numpy, in one thread; what a user
  writes without pandas (pandas is not a dependency of ours);
- DataLoader per row: a map-style torch Dataset over the TSV's lines (parsed and hashed per
  row in `__getitem__`), `DataLoader(shuffle=True, num_workers=threads)`: the usual recipe.
Hashing: `hashing.bucket_ids` over decoded blocks (numpy, one thread) against the plain
Python loop over the same values; both count values per second on one core.
"""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.tabular import hashing
from shardflow.tools.bench.core import alternate, cpu_seconds, loader_figures

BUCKETS = 2**18
DENSE, FIELDS = 13, 26


def make_tsv(path: Path, rows: int, seed: int = 0) -> Path:
    """Criteo-style headerless TSV: label, 13 counts, 26 hex ids (Zipf-like), some empty."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for lo in range(0, rows, 10_000):
            n = min(10_000, rows - lo)
            counts = rng.geometric(0.02, (n, DENSE)).astype(str)
            counts[rng.random((n, DENSE)) < 0.2] = ""
            ids = np.char.mod("%08x", (rng.zipf(1.2, (n, FIELDS)) * 2654435761) % 2**32)
            ids[rng.random((n, FIELDS)) < 0.1] = ""
            labels = (rng.random(n) < 0.25).astype(int).astype(str)
            table = np.concatenate([labels[:, None], counts, ids], axis=1)
            f.write("\n".join("\t".join(row) for row in table) + "\n")
    return path


def parse_row(fields: list[str], seeds: list[int]) -> tuple[float, list[float], list[int]]:
    """One row as the plain contenders prepare it: the loader's work, in plain Python."""
    dense = [float(np.log1p(max(float(v), 0.0))) if v else 0.0 for v in fields[1:1 + DENSE]]
    ids = [hashing.bucket_id(v.encode(), seeds[f], BUCKETS)
           for f, v in enumerate(fields[1 + DENSE:])]
    return float(fields[0]), dense, ids


class Ours:
    def __init__(self, shards: Path, batch_size: int) -> None:
        from shardflow.tabular.loader import tabular_loader

        self.loader = tabular_loader(shards, batch_size=batch_size, num_buckets=BUCKETS,
                                     device="cpu")

    def epoch(self) -> int:
        return sum(len(b) for b in self.loader)


class PlainLoop:
    """csv module -> parse and hash each row in Python -> numpy batches, one thread."""

    def __init__(self, tsv: Path, batch_size: int) -> None:
        self.tsv, self.batch = tsv, batch_size
        self.seeds = [int(s) for s in hashing.field_seeds(0, FIELDS)]

    def epoch(self) -> int:
        import torch

        rows, done = [], 0
        with open(self.tsv, newline="") as f:
            for fields in csv.reader(f, delimiter="\t"):
                rows.append(parse_row(fields, self.seeds))
                if len(rows) == self.batch:
                    done += _stack(rows, torch)
                    rows = []
        return done + (_stack(rows, torch) if rows else 0)


def _stack(rows: list[tuple[float, list[float], list[int]]], torch: Any) -> int:
    label, dense, ids = zip(*rows, strict=True)
    torch.from_numpy(np.array(dense, np.float32))
    torch.from_numpy(np.array(ids, np.int64))
    torch.from_numpy(np.array(label, np.float32))
    return len(rows)


class _RowDataset:
    """A map-style dataset of the TSV's lines, parsed and hashed one row per __getitem__."""

    def __init__(self, tsv: Path) -> None:
        self.lines = tsv.read_text().splitlines()
        self.seeds = [int(s) for s in hashing.field_seeds(0, FIELDS)]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> tuple[Any, Any, Any]:
        import torch

        label, dense, ids = parse_row(self.lines[i].split("\t"), self.seeds)
        return torch.tensor(dense), torch.tensor(ids), torch.tensor(label)


class RowDataLoader:
    def __init__(self, tsv: Path, batch_size: int, threads: int) -> None:
        from torch.utils.data import DataLoader

        self.loader: Any = DataLoader(_RowDataset(tsv),  # type: ignore[arg-type]
                                      batch_size=batch_size, shuffle=True,
                                      num_workers=threads, persistent_workers=True)

    def epoch(self) -> int:
        return sum(len(label) for _dense, _ids, label in self.loader)

    def close(self) -> None:
        del self.loader  # its persistent workers end with it


def hashing_rates(shards: Path, seconds: float = 1.0) -> dict[str, float]:
    """Values hashed per second on one core: numpy over whole blocks, and plain Python."""
    from shardflow.samples.tabular_block import decode_block
    from shardflow.shards.listing import list_shards
    from shardflow.shards.tarread import iter_samples

    with open(list_shards(str(shards))[0], "rb") as f:
        blocks = [decode_block(s["npz"]) for s in iter_samples(f, str(shards))  # type: ignore[arg-type]
                  if "npz" in s]
    buckets, seeds = np.full(FIELDS, BUCKETS), hashing.field_seeds(0, FIELDS)
    values, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for b in blocks:
            hashing.bucket_ids(b.cat_blob, b.cat_offsets, b.rows, buckets, seeds)
            values += b.rows * FIELDS
    numpy_rate = values / (time.perf_counter() - start)
    b, py_seeds = blocks[0], [int(s) for s in seeds]
    raw = [b.cat_blob[b.cat_offsets[i]: b.cat_offsets[i + 1]].tobytes()
           for i in range(len(b.cat_offsets) - 1)]
    start = time.perf_counter()
    for i, v in enumerate(raw):
        hashing.bucket_id(v, py_seeds[i // b.rows], BUCKETS)
    python_rate = len(raw) / (time.perf_counter() - start)
    return {"shardflow (numpy, one block at a time)": round(numpy_rate),
            "plain Python": round(python_rate)}


def run(args: Any) -> tuple[dict[str, Any], str]:
    """Figures for the tabular loader; returns (JSON-able result, markdown table)."""
    from shardflow.convert import ConvertConfig, convert
    from shardflow.convert.tabular import TabularOptions

    tsv = args.source or make_tsv(args.work / "day.tsv", args.rows)
    shards = args.work / "shards"
    convert(ConvertConfig(kind="tabular", src=str(tsv), out=shards, workers=args.threads,
                          max_count=8, tabular=TabularOptions(preset="criteo")))
    runs: dict[str, Any] = {"shardflow": Ours(shards, args.batch_size),
                            "plain loop": PlainLoop(tsv, args.batch_size),
                            "DataLoader per row": RowDataLoader(tsv, args.batch_size,
                                                                args.threads)}
    try:
        rows = {k: v.epoch() for k, v in runs.items()}  # also the warm-up
        timings = alternate({k: v.epoch for k, v in runs.items()}, repeats=args.repeats,
                            warmup=0, cpu_clock=cpu_seconds)
    finally:
        runs["shardflow"].loader.close()
        runs["DataLoader per row"].close()
    result: dict[str, Any] = {
        "rows": rows, "batch_size": args.batch_size, "repeats": args.repeats,
        "threads": args.threads,
        "rows_per_s": {k: round(timings.rate(k, rows[k])) for k in runs},
        "rows_per_cpu_s": {k: round(rows[k] / max(statistics.median(timings.cpu[k]), 1e-9))
                           for k in runs},
        "ratios": {f"shardflow/{k}": round(timings.ratio("shardflow", k), 3)
                   for k in runs if k != "shardflow"},
        "hashing_values_per_s_per_core": hashing_rates(shards)}
    result["shardflow"] = loader_figures(lambda: Ours(shards, args.batch_size).loader,
                                         args.epochs)
    return result, table(result)


def table(r: dict[str, Any]) -> str:
    lines = [f"tabular: Criteo-style rows (13 dense, 26 categorical into 2^18 ids), batch "
             f"{r['batch_size']}, {r['threads']} threads, median of {r['repeats']}", "",
             "| loader | rows/s | rows per CPU-s |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {r['rows_per_cpu_s'][k]} |" for k, v in r["rows_per_s"].items()]
    lines += ["", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in r["ratios"].items()]
    lines += [f"| hashing, {k} (values/s per core) | {v} |"
              for k, v in r["hashing_values_per_s_per_core"].items()]
    s = r["shardflow"]
    lines += [f"| time to first batch (s) | {s['time_to_first_batch_s']} |",
              f"| overlap (1.0 = perfect) | {s['overlap']} |",
              f"| RSS after each epoch (MB) | {s['rss_mb_after_each_epoch']} |",
              f"| peak RSS (MB) | {s['peak_rss_mb']} |"]
    return "\n".join(lines)
