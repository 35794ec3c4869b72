"""A conversion that dies part way, for the resume tests: reads a pickled spec the test wrote
(our own file, never data from outside), sets the module constants it names, runs convert()
in this process and SIGKILLs the process from the progress callback once `kill_at` samples
are written. Nothing unwinds: no finally block, no cleanup; what is on disk is what a kill
leaves there. Used through conftest.convert_killed.

    python tests/convert_killed.py SPEC.pkl
"""
import importlib
import os
import pickle
import signal
import sys

from shardflow.convert import convert

with open(sys.argv[1], "rb") as f:
    spec = pickle.load(f)  # noqa: S301 - written by the test that started this process
for name, value in spec["patches"].items():
    module, attr = name.rsplit(".", 1)
    setattr(importlib.import_module(module), attr, value)


def progress(samples: int, _bytes: int, _total: int | None) -> None:
    if samples >= spec["kill_at"]:
        os.kill(os.getpid(), signal.SIGKILL)


convert(spec["cfg"], progress)
raise SystemExit("the conversion finished before it was killed")
