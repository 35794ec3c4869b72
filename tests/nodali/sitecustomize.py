"""Makes `nvidia.dali` unimportable in every Python that starts with this folder on
PYTHONPATH (the tools the tests run too): the Makefile's second test run, which checks that
shardflow works where DALI cannot be installed (the portable backend).

    PYTHONPATH=tests/nodali .venv/bin/python -m pytest -q -m "not slow" tests/test_portable.py

Installed as an import hook rather than by hiding the package, so that a test run on a
machine with DALI installed behaves as one without it.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

BLOCKED = "nvidia.dali"


class NoDali(importlib.abc.MetaPathFinder):
    """Refuses nvidia.dali and its submodules as an absent package would be refused."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname == BLOCKED or fullname.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by "
                                      "tests/nodali/sitecustomize.py: a run without DALI)",
                                      name=fullname)
        return None


sys.meta_path.insert(0, NoDali())
