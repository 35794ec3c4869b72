#!/usr/bin/env python3
"""Verify shards: checksums, tar structure, keys, DALI index and every sample's content.

    shardflow verify shards/train [--json report.json]
    shardflow verify 'shards/train-{000000..000009}.tar' --world-size 4
    shardflow verify https://host/shards/ --index local-index/

Exits 1 when anything is wrong (each problem is named with its shard and key), 0 otherwise;
3 when a server does not answer within --timeout (the error names the URL and the wait).
With --world-size, shows how the loaders will split the shards over that many ranks: their
own plan (pipeline/loading/readplan.py: shards shuffled by (seed, epoch), each in turn to
the rank with the fewest samples, every rank reading the smallest rank's count), from the
sample counts just verified.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from shardflow.atomic import write_atomic
from shardflow.loading.readplan import plan_epoch
from shardflow.loading.shardlist import ShardSpec, Source
from shardflow.shards.verify import ShardReport, problem_counts, verify
from shardflow.storage import timed, with_timeouts
from shardflow.tools.util import (
    add_storage_options,
    add_timeout,
    bar_off,
    positive_int,
    positive_seconds,
    run_main,
)

MAX_LISTED = 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a folder with manifest.json, a glob, a brace pattern or URL")
    p.add_argument("--index", default=None, metavar="DIR",
                   help="the shards' manifest.json and .idx files lie in DIR (`shardflow index` "
                   "SRC --out DIR), not beside them")
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                   help="shards verified in parallel")
    p.add_argument("--worker-timeout", type=positive_seconds, default=900.0, metavar="SECONDS",
                   help="a shard whose check takes longer is reported hung (with --jobs > 1)")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="show how the loaders split the samples over this many ranks")
    p.add_argument("--epoch", type=int, default=0, help="the epoch of the --world-size view")
    p.add_argument("--seed", type=int, default=0, help="the loaders' seed, for that view")
    p.add_argument("--workers", type=positive_int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the whole report (shards, problems, split) as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_storage_options(p)
    add_timeout(p)
    return p


def print_table(reports: list[ShardReport]) -> None:
    width = max(len(Path(r.url).name) for r in reports)
    print(f"{'shard':<{width}}  {'samples':>8}  {'bytes':>12}  {'checksum':>8}  problems")
    for r in reports:
        checksum = "-" if r.expected is None else (
            "ok" if r.sha256 == r.expected.sha256 else "BAD")
        print(f"{Path(r.url).name:<{width}}  {r.samples:>8}  {r.bytes:>12}  {checksum:>8}  "
              f"{len(r.problems) or ''}")


def print_problems(reports: list[ShardReport]) -> None:
    problems = [p for r in reports for p in r.problems]
    for p in problems[:MAX_LISTED]:
        key = f" key {p['key']!r}" if p["key"] else ""
        print(f"  {p['source']}{key}: {p['detail']} [{p['reason']}]")
    if len(problems) > MAX_LISTED:
        print(f"  ... and {len(problems) - MAX_LISTED} more")
    print("problems by reason: " + ", ".join(f"{k}={v}" for k, v in
                                             problem_counts(reports).items()))


def print_unindexed(reports: list[ShardReport]) -> None:
    """The shards `shardflow index` left without an index: read all the same, by the
    streaming reader, which is no problem but is slower than DALI's reader."""
    names = [f"{Path(r.url).name} [{r.expected.unindexed}]" for r in reports
             if r.expected is not None and r.expected.unindexed]
    if names:
        print(f"{len(names)} shards have no index ({', '.join(names[:5])}"
              f"{' ...' if len(names) > 5 else ''}): the loaders stream them, so DALI's reader "
              "reads none of this folder; `shardflow convert shards` rewrites them")


def split_view(reports: list[ShardReport], world_size: int, epoch: int, seed: int
               ) -> dict[str, Any]:
    """The loaders' own split of these shards (training order) over `world_size` ranks, or
    {"error": why} when they would refuse it."""
    source = Source(tuple(ShardSpec(r.url, r.samples) for r in reports))
    try:
        plans = [plan_epoch(source, epoch=epoch, seed=seed, rank=rank, world_size=world_size,
                            shuffle=True, batch_size=1, shuffle_buffer=0)
                 for rank in range(world_size)]
    except ValueError as err:
        return {"world_size": world_size, "epoch": epoch, "seed": seed, "error": str(err)}
    return {"world_size": world_size, "epoch": epoch, "seed": seed,
            "samples_per_rank": plans[0].length, "dropped": plans[0].dropped,
            "ranks": [{"rank": p.rank, "shards": [Path(s.url).name for s in p.shards],
                       "samples_in_shards": sum(s.samples or 0 for s in p.shards)}
                      for p in plans]}


def print_split(view: dict[str, Any]) -> bool:
    """The split view; False when the loaders would refuse it."""
    print(f"\nsplit over {view['world_size']} ranks, epoch {view['epoch']} (seed "
          f"{view['seed']}; shards are reshuffled every epoch, so is this split):")
    if "error" in view:
        print(f"warning: the loaders would refuse it: {view['error']}")
        return False
    for rank in view["ranks"]:
        print(f"  rank {rank['rank']}: {len(rank['shards'])} shards, "
              f"{rank['samples_in_shards']} samples")
    print(f"every rank reads {view['samples_per_rank']} samples; {view['dropped']} are left "
          "out this epoch to even the ranks (other samples are left out in other epochs)")
    return True


def report_json(reports: list[ShardReport], manifest: Any, split: dict[str, Any] | None
                ) -> dict[str, Any]:
    checksum = {r.url: None if r.expected is None else r.sha256 == r.expected.sha256
                for r in reports}
    return {"ok": all(r.ok for r in reports),
            "shards": [{"url": r.url, "samples": r.samples, "bytes": r.bytes,
                        "checksum_ok": checksum[r.url], "problems": r.problems}
                       for r in reports],
            "samples": sum(r.samples for r in reports),
            "manifest_samples": manifest.total_samples if manifest else None,
            "problems_by_reason": problem_counts(reports), "split": split}


def verify_with_progress(args: argparse.Namespace) -> tuple[list[ShardReport], Any]:
    from tqdm import tqdm

    with tqdm(unit="shard", disable=bar_off(args.quiet), file=sys.stderr, leave=False,
              dynamic_ncols=True) as bar:
        def progress(samples: int, shards: int) -> None:
            bar.total = shards
            bar.update()
            bar.set_postfix(samples=samples)

        options = with_timeouts(args.storage_options, args.source, seconds=args.timeout)
        # a shard's own timeout names the shard; one met here, finding the shards
        with timed("listing", args.source, options):
            return verify(args.source, workers=args.jobs, timeout_s=args.worker_timeout,
                          progress=progress, storage_options=options, index=args.index)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers is not None:
        raise ValueError("--workers is gone: the loaders have no data-loader "
                         "workers (one process per rank reads with its own threads); "
                         "--world-size alone shows their split")
    reports, manifest = verify_with_progress(args)
    print_table(reports)
    total = sum(r.samples for r in reports)
    print(f"{len(reports)} shards, {total} samples"
          + (f" (manifest: {manifest.total_samples})" if manifest else " (no manifest)"))
    print_unindexed(reports)
    split = split_view(reports, args.world_size, args.epoch, args.seed) \
        if args.world_size else None
    balanced = print_split(split) if split else True
    if args.json:
        write_atomic(args.json, (json.dumps(report_json(reports, manifest, split), indent=1)
                                 + "\n").encode())
    if any(not r.ok for r in reports):
        print_problems(reports)
        return 1
    print("all shards verified: no problems" + ("" if balanced else
                                                 " (but see the split warning above)"))
    return 0


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    run_main(lambda: main(argv))


if __name__ == "__main__":
    entry()
