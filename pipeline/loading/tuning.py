"""The tuning file: the loader configuration measured fastest on this machine.

`tools/bench_loader.py --tune` measures the choices that matter (decode device, reader, DALI
threads, prefetch depth, where resize/flip/normalize run after a CPU decode, and on a GPU the
hardware JPEG decoder's share) and writes the winner here; `image_loader` then uses it for every
choice left automatic (device, reader and resize_on "auto", threads and prefetch not given) and
logs
that it did and where the figures come from. A file measured on another machine (other CPU
count or GPU) is ignored, with a log line saying so.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
VERSION = 1


def default_path() -> Path:
    return Path.home() / ".cache" / "shardflow" / "tuning.json"


def this_machine() -> dict[str, Any]:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpus": cores, "gpu": gpu}


@dataclass(frozen=True)
class Tuning:
    """The winning configuration and the table it won in."""

    device: str
    reader: str
    threads: int
    prefetch: int
    images_per_s: float
    table: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=this_machine)
    measured: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M"))
    hw_decoder_load: float | None = None  # measured on GPU machines only
    resize_on: str | None = None  # "torch" or "dali" for a CPU winner (files before: None)

    def save(self, path: Path) -> None:
        from pipeline.atomic import write_atomic

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps({"version": VERSION, **asdict(self)}, indent=1) + "\n")
                     .encode())

    def choices(self) -> dict[str, Any]:
        chosen = {"device": self.device, "reader": self.reader, "threads": self.threads,
                  "prefetch": self.prefetch}
        if self.device == "gpu" and self.hw_decoder_load is not None:
            chosen["hw_decoder_load"] = self.hw_decoder_load
        if self.device == "cpu" and self.resize_on is not None:
            chosen["resize_on"] = self.resize_on
        return chosen


def load(path: Path | None = None) -> Tuning | None:
    """The tuning file for this machine, or None (missing, unreadable, another machine)."""
    path = path or default_path()
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.pop("version") != VERSION:
            raise ValueError("another version")
        tuning = Tuning(**doc)
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring tuning file %s: %s", path, exc)
        return None
    if tuning.machine != this_machine():
        log.info("ignoring tuning file %s: measured on %s, this is %s", path, tuning.machine,
                 this_machine())
        return None
    return tuning


def apply(options: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """`options` with the tuned choices filled in where the caller left them automatic."""
    tuning = load(path)
    if tuning is None:
        return options
    tuned = dict(options)
    for name, value in tuning.choices().items():
        if name in ("device", "reader", "resize_on") and tuned.get(name, "auto") == "auto":
            tuned[name] = value
        elif name not in tuned:
            tuned[name] = value
    used = {k: v for k, v in tuned.items() if options.get(k) != v}
    if used:
        log.info("image loader: %s from the tuning file %s (measured %s: %.0f images/s)", used,
                 path or default_path(), tuning.measured, tuning.images_per_s)
    return tuned
