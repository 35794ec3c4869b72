"""`shardflow verify` from a checkout; the command is pipeline/cli/verify_shards.py.

Kept so that `python tools/verify_shards.py ...` goes on working, and so that this file can be
imported as the module it was (its names are the command module's).
"""

from pipeline.cli import verify_shards as _command


def __getattr__(name: str) -> object:
    return getattr(_command, name)


if __name__ == "__main__":
    _command.entry()
