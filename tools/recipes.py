"""`shardflow recipes DIR`: the cluster recipes (SLURM batch script, Kubernetes PyTorchJob,
indexed conversion Job, shared volume, and their README), written into DIR to edit. They are
package data (tools/cluster/), so an installed shardflow has them too.

    shardflow recipes cluster/
    sbatch cluster/slurm_train.sbatch
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path
from typing import NoReturn

from shardflow.tools.util import run_main


def recipe_files() -> dict[str, bytes]:
    """Each recipe's file name and bytes, as installed."""
    folder = resources.files("shardflow.tools") / "cluster"
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder to write them into (made if missing)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace recipe files already in the folder (edited ones included)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files = recipe_files()
    there = sorted(name for name in files if (args.out / name).exists())
    if there and not args.overwrite:
        raise FileExistsError(f"{args.out} already holds {', '.join(there)}: edited recipes "
                              "are not replaced; pass --overwrite, or another folder")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in sorted(files.items()):
        (args.out / name).write_bytes(data)
        print(args.out / name)
    return 0


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    run_main(lambda: main(argv))


if __name__ == "__main__":
    entry()
