#!/usr/bin/env python3
"""Draw a run folder's curves.png from its metrics.jsonl and eval.jsonl: loss (train and
eval), the eval metrics, samples/s and the data-wait share per logged step.

    shardflow plot runs/r1                   # (re)writes runs/r1/curves.png
    shardflow plot runs/r1 --out r1.png

train.py draws the same figure at the end of a run; this draws it at any time: while the run
is going, or after it was killed. Needs matplotlib, which installs with shardflow.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from shardflow.tools.util import run_main
from shardflow.trainers.curves import draw


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run folder (train.py --out)")
    p.add_argument("--out", type=Path, default=None,
                   help="where the PNG goes (default: RUN_DIR/curves.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    out, steps = draw(args.run_dir, args.out)
    print(f"{out}: {steps} logged steps")
    return 0


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    # ImportError: matplotlib (a dependency) missing from this environment
    run_main(lambda: main(argv), usage=(ImportError,))


if __name__ == "__main__":
    entry()
