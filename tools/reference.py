"""The command-line reference (docs/cli.md), made from the parsers themselves: every
subcommand's `--help`, and each of `convert`'s kinds, as the command prints them.

    python -m shardflow.tools.reference > docs/cli.md      # what tests/test_cli.py compares

A test regenerates it and compares, so the reference cannot drift from the options.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
from collections.abc import Iterator

from shardflow.tools.main import COMMANDS, build_parser, prog_of

WIDTH = "100"  # argparse wraps help to $COLUMNS: fixed, so the text is the same everywhere
KINDS = ("imagefolder", "manifest", "text", "pointcloud", "shards", "parquet", "tabular",
         "index", "merge")  # convert's own subcommands


def help_text(name: str | None, args: tuple[str, ...] = ()) -> str:
    """What `shardflow [name] [args] --help` prints."""
    out = io.StringIO()
    try:
        with _columns(), contextlib.redirect_stdout(out):
            if name is None:
                build_parser().parse_args(["--help"])
            else:
                module, first, _summary = COMMANDS[name]
                saved, sys.argv = sys.argv, [prog_of(name)]
                try:
                    importlib.import_module(module).entry([*first, *args, "--help"])
                finally:
                    sys.argv = saved
    except SystemExit as done:  # --help exits 0; anything else is a broken parser
        if done.code not in (0, None):
            raise RuntimeError(f"shardflow {name or ''} {' '.join(args)} --help exited "
                               f"{done.code}") from None
    return out.getvalue()


@contextlib.contextmanager
def _columns() -> Iterator[None]:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def reference() -> str:
    """docs/cli.md's text."""
    parts = ["# The `shardflow` command", "",
             "Made by `python -m shardflow.tools.reference > docs/cli.md` from the parsers; a test "
             "checks that it is current. Exit codes: 0 done, 1 a data error (shard, key, "
             "reason), 2 a usage error, 3 another OS error (a full disk, a permission, a "
             "server that did not answer within --timeout: docs/reliability.md), 4 a worker "
             "process hung or died.", "", "```text", help_text(None).rstrip(), "```"]
    for name in COMMANDS:
        parts += ["", f"## shardflow {name}", "", "```text", help_text(name).rstrip(), "```"]
        if name == "convert":
            for kind in KINDS:
                parts += ["", f"### shardflow convert {kind}", "", "```text",
                          help_text(name, (kind,)).rstrip(), "```"]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
