#!/usr/bin/env python3
"""Verify shards: checksums, tar structure, keys, DALI index and every sample's content.

    python tools/verify_shards.py shards/train
    python tools/verify_shards.py 'shards/train-{000000..000009}.tar' --world-size 4 --workers 2

Exits 1 when anything is wrong (each problem is named with its shard and key), 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cliutil import positive_int, positive_seconds, run_main

from pipeline.loading.split import assignment
from pipeline.shards.verify import ShardReport, problem_counts, verify

MAX_LISTED = 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a folder with manifest.json, a glob, a brace pattern or URL")
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                   help="shards verified in parallel")
    p.add_argument("--worker-timeout", type=positive_seconds, default=900.0, metavar="SECONDS",
                   help="a shard whose check takes longer is reported hung (with --jobs > 1)")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="show how samples would fall on this many ranks")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="data-loader workers per rank, for the --world-size view")
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


def print_split(reports: list[ShardReport], world_size: int, workers: int) -> bool:
    """Samples per rank and worker; False when some would get nothing."""
    plan = assignment(reports, world_size, workers)
    print(f"\nsplit over {world_size} ranks x {workers} workers (shards round-robin):")
    empty = []
    for (rank, worker), shards in plan.items():
        samples = sum(r.samples for r in shards)
        print(f"  rank {rank} worker {worker}: {len(shards)} shards, {samples} samples")
        if samples == 0:
            empty.append((rank, worker))
    if empty:
        print(f"warning: {len(empty)} of {len(plan)} rank/worker slots get no samples "
              f"({len(reports)} shards for {world_size * workers} slots); re-shard with a "
              "smaller --max-count, or use fewer ranks or workers")
    return not empty


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reports, manifest = verify(args.source, workers=args.jobs, timeout_s=args.worker_timeout)
    print_table(reports)
    total = sum(r.samples for r in reports)
    print(f"{len(reports)} shards, {total} samples"
          + (f" (manifest: {manifest.total_samples})" if manifest else " (no manifest)"))
    balanced = print_split(reports, args.world_size, args.workers) if args.world_size else True
    if any(not r.ok for r in reports):
        print_problems(reports)
        return 1
    print("all shards verified: no problems" + ("" if balanced else
                                                 " (but see the split warning above)"))
    return 0


if __name__ == "__main__":
    run_main(main)
