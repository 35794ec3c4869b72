"""`shardflow train-tokenizer` from a checkout; the command is pipeline/cli/train_tokenizer.py.

Kept so that `python tools/train_tokenizer.py ...` goes on working, and so that this file can be
imported as the module it was (its names are the command module's).
"""

from pipeline.cli import train_tokenizer as _command


def __getattr__(name: str) -> object:
    return getattr(_command, name)


if __name__ == "__main__":
    _command.entry()
