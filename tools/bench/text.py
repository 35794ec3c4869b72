"""The text loader benchmark: tokens/s through read + check + tokenize + pack + mask with our
loader, against the same tokenizer in plain loops on the same shards, alternated in one run.

Contenders, per tokenizer (the built-in bytes, and a BPE trained on the corpus when HF
tokenizers is installed):
- shardflow: `text_loader(..., objective="mlm")`, one pass, tokens counted from the masks;
- plain loop: the shards read with `tarfile`, each document decoded and tokenized alone, rows
  packed with numpy and masked the same way, in one thread: what a user writes by hand;
- tokenizer alone: `encode_batch` over the documents already in memory, as many a call as the
  loader reads at once (the ceiling for any loader that tokenizes; ours/this is the overhead
  of everything else);
- shardflow pre-tokenized: the same loader on the shards converted with `make_shards shards
  --tokenizer` (text/pretokenized.py): the same batches, no tokenizer run;
- LitData TokensLoader (bench extra): the same token ids (each document's, then the
  separator) written by `litdata.optimize` and read in blocks of seq_len by its
  StreamingDataset + StreamingDataLoader in `threads` workers, shuffled. It neither masks nor
  makes labels: ours does both (MLM), so the ratio against it is the conservative one.
Also reported: tokens per CPU-second of each (the issue's "per CPU thread"), and for ours the
time to first batch, the overlap figure and resident memory per epoch (bench.loader_figures).
"""

from __future__ import annotations

import functools
import multiprocessing
import shutil
import statistics
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.text import masking, packing
from shardflow.text.config import TextConfig
from shardflow.text.tokenizer import Tokenizer, load_tokenizer, train_bpe
from shardflow.tools.bench.core import alternate, cpu_seconds, loader_figures
from shardflow.tools.bench.peers import _environ, importable

SEQ_LEN = 128


class Ours:
    def __init__(self, shards: Path, tokenizer: Tokenizer, batch_size: int) -> None:
        from shardflow.text.loader import text_loader

        self.loader = text_loader(shards, batch_size=batch_size, seq_len=SEQ_LEN,
                                  objective="mlm", tokenizer=tokenizer, device="cpu")

    def epoch(self) -> int:
        # Counted in numpy, as the plain loop counts: a torch op per batch here cost the
        # loader's epoch about 1.2x more (its stage thread waits for the GIL meanwhile), which
        # would measure the counting, not the loader.
        return sum(int(b.attention_mask.numpy().sum()) for b in self.loader)


class PlainLoop:
    """tarfile -> decode -> tokenize one document at a time -> pack -> mask, one thread."""

    def __init__(self, shards: Path, tokenizer: Tokenizer, batch_size: int) -> None:
        self.paths = sorted(shards.glob("*.tar"))
        self.tok, self.rows = tokenizer, batch_size

    def epoch(self) -> int:
        tok, size = self.tok, self.rows * SEQ_LEN
        buffer: list[np.ndarray] = []
        held, tokens, index = 0, 0, 0
        for path in self.paths:
            with tarfile.open(path) as tar:
                for member in tar:
                    if not member.name.endswith(".txt"):
                        continue
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    doc = tok.encode_batch([data.decode("utf-8")])[0]
                    buffer += [doc, np.array([tok.sep_id], np.int32)]
                    held += len(doc) + 1
                    while held >= size:
                        stream = np.concatenate(buffer)
                        tokens += self._batch(stream[:size], index)
                        buffer, held, index = [stream[size:]], held - size, index + 1
        if held:
            tokens += self._batch(np.concatenate(buffer), index)
        return tokens

    def _batch(self, stream: np.ndarray, index: int) -> int:
        ids, attention = packing.rows(stream, SEQ_LEN, self.tok.pad_id)
        assert self.tok.mask_id is not None
        masking.mlm(ids, attention, masking.batch_rng(0, 0, 0, index), mask_id=self.tok.mask_id,
                    normal_ids=self.tok.normal_ids,
                    special_ids=self.tok.special_ids)
        return int(attention.sum())


class TokenizerAlone:
    """encode_batch over documents already decoded in memory: no reading, packing, masking.
    As many documents a call as the loader's reads hold (HF's encoder runs faster on larger
    calls: 0.91x the time at 256 documents a call as at 64 here), so that the ratio is the
    overhead of the loader's other work."""

    def __init__(self, shards: Path, tokenizer: Tokenizer, batch_size: int) -> None:
        self.tok = tokenizer
        self.batch = TextConfig(batch_size=batch_size, seq_len=SEQ_LEN).read_size()
        self.docs = _documents(shards)

    def epoch(self) -> int:
        count = 0
        for i in range(0, len(self.docs), self.batch):
            count += sum(len(d) + 1 for d in self.tok.encode_batch(self.docs[i: i + self.batch]))
        return count


class LitDataTokens:
    """LitData's TokensLoader over the same ids: blocks of SEQ_LEN tokens, batch_size a
    batch, from `threads` worker processes (its StreamingDataLoader)."""

    def __init__(self, ids: Path, work: Path, tok: Tokenizer, batch_size: int, threads: int
                 ) -> None:
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        self.dir = work / f"litdata-{ids.name}"
        write_litdata_tokens(ids, self.dir, tok.sep_id, threads)
        self.dataset = StreamingDataset(input_dir=str(self.dir), shuffle=True,
                                        item_loader=TokensLoader(block_size=SEQ_LEN))
        self.loader = StreamingDataLoader(self.dataset, batch_size=batch_size,
                                          num_workers=threads, persistent_workers=True)

    def epoch(self) -> int:
        return sum(int(block.numel()) for block in self.loader)


def _with_separator(item: tuple[bytes, str, int]) -> Any:
    """optimize()'s function (in its worker processes): a document's stored ids -> the int32
    tensor of them and the separator, as our loader packs it."""
    import torch

    data, dtype, sep = item
    ids = np.append(np.frombuffer(data, dtype).astype(np.int32), np.int32(sep))
    return torch.from_numpy(ids)


def write_litdata_tokens(ids: Path, out: Path, sep_id: int, workers: int) -> None:
    """The documents of the pre-tokenized shards `ids`, in shard order, as a LitData token
    dataset in `out` (replaced); its scratch folders in `out`.cache, removed after."""
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    from shardflow.shards.manifest import load_manifest

    form = load_manifest(str(ids / "manifest.json")).tokens
    assert form is not None
    dtype = "<u2" if form.dtype == "uint16" else "<u4"
    items = [(data, dtype, sep_id) for data in _members(ids, form.member)]
    shutil.rmtree(out, ignore_errors=True)
    scratch = out.with_name(out.name + ".cache")
    start_method = multiprocessing.get_start_method(allow_none=True)  # see bench/peers.py
    try:
        with _environ(DATA_OPTIMIZER_CACHE_FOLDER=str(scratch / "chunks"),
                      DATA_OPTIMIZER_DATA_CACHE_FOLDER=str(scratch / "data")):
            litdata.optimize(fn=_with_separator, inputs=items, output_dir=str(out),
                             num_workers=workers, chunk_bytes="64MB", reorder_files=False,
                             keep_data_ordered=True, verbose=False, item_loader=TokensLoader())
    finally:
        multiprocessing.set_start_method(start_method, force=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _members(shards: Path, ext: str) -> list[bytes]:
    found = []
    for path in sorted(shards.glob("*.tar")):
        with tarfile.open(path) as tar:
            found += [tar.extractfile(m).read()  # type: ignore[union-attr]
                      for m in tar if m.name.endswith("." + ext)]
    return found


def pre_tokenized(shards: Path, work: Path, name: str, spec: str) -> Path:
    """The text shards converted to ids of `spec` (make_shards shards --tokenizer)."""
    from shardflow.convert import ConvertConfig, convert
    from shardflow.convert.sources import TextOptions

    out = work / f"ids-{name}"
    convert(ConvertConfig(kind="shards", src=str(shards), out=str(out), max_count=200,
                          overwrite=True, text=TextOptions(tokenizer=spec)))
    return out


def _loader(shards: Path, tok: Tokenizer, batch_size: int) -> Any:
    return Ours(shards, tok, batch_size).loader


def tokenizers(work: Path, shards: Path) -> dict[str, str]:
    """The built-in bytes, and a 2000-token BPE trained on the corpus when HF tokenizers is
    installed: name -> what load_tokenizer and make_shards --tokenizer take."""
    found = {"bytes": "bytes"}
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return found
    path = work / "bpe.json"
    train_bpe(_documents(shards), path, 2000)
    found["bpe-2000"] = str(path)
    return found


def _documents(shards: Path) -> list[str]:
    docs = []
    for path in sorted(shards.glob("*.tar")):
        with tarfile.open(path) as tar:
            docs += [tar.extractfile(m).read().decode("utf-8")  # type: ignore[union-attr]
                     for m in tar if m.name.endswith(".txt")]
    return docs


def run(shards: Path, work: Path, batch_size: int, repeats: int, epochs: int = 4,
        threads: int = 2) -> tuple[dict[str, Any], str]:
    """Figures for every tokenizer; returns (JSON-able result, markdown table)."""
    result: dict[str, Any] = {"seq_len": SEQ_LEN, "batch_size": batch_size, "repeats": repeats,
                              "tokenizers": {}}
    litdata = importable("LitData")
    for name, spec in tokenizers(work, shards).items():
        tok = load_tokenizer(spec)
        ids = pre_tokenized(shards, work, name, spec)
        runs: dict[str, Any] = {"shardflow": Ours(shards, tok, batch_size),
                "plain loop": PlainLoop(shards, tok, batch_size),
                "tokenizer alone": TokenizerAlone(shards, tok, batch_size),
                "shardflow pre-tokenized": Ours(ids, tok, batch_size)}
        if litdata:
            runs["LitData TokensLoader"] = LitDataTokens(ids, work, tok, batch_size, threads)
        counts = {k: v.epoch() for k, v in runs.items()}  # also the warm-up
        timings = alternate({k: v.epoch for k, v in runs.items()}, repeats=repeats, warmup=0,
                            cpu_clock=cpu_seconds)
        result["tokenizers"][name] = {
            "tokens": counts,  # equal for all: the same work
            "tokens_per_s": {k: round(timings.rate(k, counts[k])) for k in runs},
            "tokens_per_cpu_s": {k: round(counts[k] / max(statistics.median(timings.cpu[k]),
                                                           1e-9)) for k in runs},
            "ratios": {"shardflow/plain loop": round(timings.ratio("shardflow", "plain loop"),
                                                     3),
                       "shardflow/tokenizer alone": round(
                           timings.ratio("shardflow", "tokenizer alone"), 3),
                       "pre-tokenized/shardflow": round(
                           timings.ratio("shardflow pre-tokenized", "shardflow"), 3),
                       **({"pre-tokenized/LitData TokensLoader": round(timings.ratio(
                           "shardflow pre-tokenized", "LitData TokensLoader"), 3)}
                          if "LitData TokensLoader" in runs else {})},
        }
        runs["shardflow"].loader.close()
        runs["shardflow pre-tokenized"].loader.close()
        result["tokenizers"][name].update(
            loader_figures(functools.partial(_loader, shards, tok, batch_size), epochs))
    return result, table(result)


def table(r: dict[str, Any]) -> str:
    lines = [f"text: rows of {r['seq_len']} tokens, batch {r['batch_size']}, masking 15%, "
             f"median of {r['repeats']}", "",
             "| tokenizer | loader | tokens/s | tokens per CPU-s |", "|---|---|---|---|"]
    for name, t in r["tokenizers"].items():
        lines += [f"| {name} | {k} | {v} | {t['tokens_per_cpu_s'][k]} |"
                  for k, v in t["tokens_per_s"].items()]
    lines += ["", "| tokenizer | ratio | value |", "|---|---|---|"]
    for name, t in r["tokenizers"].items():
        lines += [f"| {name} | {k} | {v} |" for k, v in t["ratios"].items()]
        lines += [f"| {name} | time to first batch (s) | {t['time_to_first_batch_s']} |",
                  f"| {name} | overlap (1.0 = perfect) | {t['overlap']} |",
                  f"| {name} | RSS after each epoch (MB) | {t['rss_mb_after_each_epoch']} |",
                  f"| {name} | peak RSS (MB) | {t['peak_rss_mb']} |"]
    return "\n".join(lines)
