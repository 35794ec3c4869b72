"""`shardflow SUBCOMMAND ...`: the project's command, installed with the package.

    shardflow convert imagefolder photos/ shards/     # make_shards.py
    shardflow verify shards/                          # verify_shards.py
    shardflow train --task image --data shards/ --steps 300
    shardflow bench --images 400                      # bench_loader.py
    shardflow --version

Each subcommand is a module with `entry(argv)` (its `main`, errors mapped to exit codes as
util.run_main documents), named here by its import path and
imported only when it runs: `shardflow --help` stays quick, and the conversion side's
commands never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from importlib import metadata
from typing import NoReturn

# subcommand -> (module with main(argv), arguments put before the user's, what it does)
COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "data": ("shardflow.tools.data", (), "the built-in datasets as raw files, to try things on"),
    "convert": ("shardflow.tools.make_shards", (), "convert a dataset to shards"),
    "index": ("shardflow.tools.make_shards", ("index",),
              "DALI indexes and a manifest for shards made elsewhere (= convert index)"),
    "verify": ("shardflow.tools.verify_shards", (), "check shards against manifest and indexes"),
    "show": ("shardflow.tools.show_shards", (), "look at samples: a grid, statistics, one sample"),
    "train": ("shardflow.tools.train", (), "train on shards (image, text, point clouds, CTR)"),
    "demo": ("shardflow.tools.demo", (), "convert the built-in data and train on each modality"),
    "bench": ("shardflow.tools.bench_loader", (), "loader throughput beside the baselines"),
    "tune": ("shardflow.tools.bench_loader", ("--tune",),
             "measure loader settings here and write the tuning file (= bench --tune)"),
    "bench-convert": ("shardflow.tools.bench_convert", (), "conversion speed beside tar and peers"),
    "bench-stream": ("shardflow.tools.bench_stream", (), "the streaming reader over HTTP"),
    "gpu-check": ("shardflow.tools.gpu_check", (), "the GPU figures (on a CUDA machine)"),
    "recipes": ("shardflow.tools.recipes", (), "the SLURM and Kubernetes recipes, to edit"),
    "soak": ("shardflow.tools.soak", (), "long runs: memory and threads stay flat"),
    "train-tokenizer": ("shardflow.tools.train_tokenizer", (), "a BPE tokenizer from text shards"),
    "plot": ("shardflow.tools.plot_run", (), "redraw a run's curves.png"),
}


def version() -> str:
    try:
        return metadata.version("shardflow")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardflow", description="shardflow: WebDataset shards, loaders and training.",
        epilog="`shardflow SUBCOMMAND --help` gives each one's options.")
    p.add_argument("--version", action="version", version=f"shardflow {version()}")
    sub = p.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    for name, (_module, _first, summary) in COMMANDS.items():
        # Each subcommand parses its own arguments: here only its name is taken.
        sub.add_parser(name, help=summary, add_help=False)
    return p


def prog_of(name: str) -> str:
    """sys.argv[0] for subcommand `name`, which its parser names itself after ("usage:
    shardflow convert"); one that starts with a subcommand of its own (index) adds that."""
    first = COMMANDS[name][1]
    return "shardflow" if first and not first[0].startswith("-") else f"shardflow {name}"


def main(argv: list[str] | None = None) -> NoReturn:
    """Run `argv`'s subcommand (exits with its code: util.run_main's table)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv:
        parser.error(f"name a subcommand: {', '.join(COMMANDS)}")
    if argv[0].startswith("-"):
        parser.parse_args(argv)  # --help, --version, or the error that names the choices
        raise SystemExit(2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        parser.parse_args([name])  # exits 2 naming the choices
    module, first, _summary = COMMANDS[name]
    entry: Callable[[list[str]], NoReturn] = importlib.import_module(module).entry
    saved, sys.argv = sys.argv, [prog_of(name), *rest]
    try:
        entry([*first, *rest])  # exits: errors as one line and a code (util.run_main)
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
