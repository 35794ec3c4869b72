"""`shardflow bench-convert` from a checkout; the command is pipeline/cli/bench_convert.py.

Kept so that `python tools/bench_convert.py ...` goes on working, and so that this file can be
imported as the module it was (its names are the command module's).
"""

from pipeline.cli import bench_convert as _command


def __getattr__(name: str) -> object:
    return getattr(_command, name)


if __name__ == "__main__":
    _command.entry()
