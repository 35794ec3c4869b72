"""`shardflow` from a checkout on a machine where nothing installs: a folder of links laid out as
the wheel lays the package out, to put on PYTHONPATH.

    python3 tools/checkout.py build/checkout
    PYTHONPATH=build/checkout python3 -m shardflow gpu-check --json gpu.json

The wheel maps three folders to one package (pyproject.toml's package-dir): pipeline/ is
`shardflow`, trainers/ is `shardflow.trainers`, tools/ is `shardflow.tools`. An installed
package (`pip install .`, or `-e .`) needs none of this. The lent GPU machine installs nothing,
and mypy cannot follow an editable install's import hook; both read this tree instead. The
links point into the checkout, so edits show at once; a new top-level entry of pipeline/ needs
the command again. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("trainers", "tools")  # folders of the checkout that are shardflow.<folder>


def link_tree(dest: Path) -> Path:
    """Write dest/shardflow: a link to each entry of pipeline/, and to trainers/ and tools/ as
    its subpackages. Returns the folder to put on PYTHONPATH (dest)."""
    package = dest / "shardflow"
    if package.is_symlink():
        package.unlink()
    elif package.exists():
        shutil.rmtree(package)  # it holds links only: rmtree removes them, not their targets
    package.mkdir(parents=True)
    for entry in sorted((ROOT / "pipeline").iterdir()):
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in SUBPACKAGES:
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path, help="the folder to write (its shardflow/ is replaced)")
    args = p.parse_args(argv)
    print(link_tree(args.dest).resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
