"""`shardflow show` from a checkout; the command is pipeline/cli/show_shards.py.

Importable as a module too (its names are the command module's).
"""

from pipeline.cli import show_shards as _command


def __getattr__(name: str) -> object:
    return getattr(_command, name)


if __name__ == "__main__":
    _command.entry()
