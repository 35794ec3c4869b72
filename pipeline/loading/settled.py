"""What a `*_loader` function settles of the options its caller left unset, and the record of
it the loader keeps (`loader.settled`), so that a report (summary.json's `loader`) reads where
each choice came from off the built loader instead of working it out again.

    the caller's option  >  the tuning file's choice (tuning.py)  >  the factory's rule
                         >  the config's default

The rules: decode threads are this process's cores divided among the ranks on its node
(`local_world_size`, e.g. torchrun's LOCAL_WORLD_SIZE: ranks on one node share its cores);
the image loader's prefetch is deeper when a CPU loader runs the user's ops (image/loader.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardflow.loading.options import cores

Rules = dict[str, tuple[Any, str]]  # option -> (its value, why), applied where still unset


@dataclass(frozen=True)
class Settled:
    """Which options a factory filled in: `tuned`, the tuning file's choices it took (the
    file: `tuning_file`); `rules`, the options one of its rules set, each with why. Empty
    for a loader built from its class directly."""

    tuned: Mapping[str, Any] = field(default_factory=dict)
    tuning_file: str | None = None
    rules: Mapping[str, str] = field(default_factory=dict)

    def origin(self, name: str) -> str | None:
        """Where option `name` came from: "the tuning file", a rule's why, or None (the
        caller's value, or the config's default)."""
        return "the tuning file" if name in self.tuned else self.rules.get(name)


def settle(asked: Mapping[str, Any], tuned: Mapping[str, Any], tuning_file: Path | None,
           rules: Rules) -> tuple[dict[str, Any], Settled]:
    """The options to build with: `tuned` (`asked`, the caller's, with the tuning file's
    choices filled in) and each rule's value where neither set it; and the record of both."""
    # backend: settled by image/choose.py (the photos' sizes), not a tuned choice
    taken = {k: v for k, v in tuned.items() if k != "backend" and asked.get(k) != v}
    options, why = dict(tuned), {}
    for name, (value, reason) in rules.items():
        if name not in options:
            options[name], why[name] = value, reason
    path = None
    if taken:
        from shardflow.loading import tuning

        path = str(tuning_file or tuning.default_path())
    return options, Settled(taken, path, why)


def thread_rule(local_world_size: int) -> Rules:
    """Decode threads nobody chose: the cores this process may run on, divided among the
    `local_world_size` ranks on this node (at least one each)."""
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) \
            or local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size!r}: the ranks on this node, a "
                         "positive integer (under torchrun: int(os.environ['LOCAL_WORLD_SIZE']))")
    n = cores()
    if local_world_size == 1:
        return {"threads": (n, f"all {n} cores")}
    return {"threads": (max(1, n // local_world_size),
                        f"{n} cores / local_world_size={local_world_size} ranks on this node")}
