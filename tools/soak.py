"""`shardflow soak` from a checkout; the command is trainers/cli/soak.py.

Kept so that `python tools/soak.py ...` goes on working, and so that this file can be
imported as the module it was (its names are the command module's).
"""

from trainers.cli import soak as _command


def __getattr__(name: str) -> object:
    return getattr(_command, name)


if __name__ == "__main__":
    _command.entry()
