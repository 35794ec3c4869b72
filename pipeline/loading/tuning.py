"""The tuning file: the loader configuration measured fastest on this machine.

`tools/bench_loader.py --tune` measures the choices that matter (where decoding runs, reader,
DALI threads, prefetch depth, where resize/flip/normalize run after a CPU decode (for uint8 and
for float output apart), and on a GPU the hardware JPEG decoder's share) and writes the winner
here, with both backends' fastest rates on that corpus (`backend_split`, image/choose.py).
Every loader then uses it for the choices left automatic that apply to it (decode, reader and
resize_on "auto", threads and prefetch not given) and logs that it did and where the figures
come from. A tuned choice is applied only where it is possible for the source and
placement at hand: DALI's reader only for local indexed shards, GPU decoding only when batches
land on a GPU. A file measured on another machine (other CPU count or GPU) is ignored, with a
log line saying so. (The file's `device` field is where decoding ran: the `decode` option.)
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
    # The same choice measured with normalize=True (float out), which moves the work: the
    # graph's crop_mirror_normalize, or resize.py's per-image normalize into the batch.
    resize_on_float: str | None = None
    # Both backends on each corpus tuned on: {"side_ratio": median shorter side / output size,
    # "dali": images/s, "portable": images/s}; image/choose.py draws backend="auto"'s line
    backend_split: list[dict[str, float]] = field(default_factory=list)
    # The portable backend's fastest threads and prefetch (measured beside DALI's with
    # backend auto): what a loader that runs it takes instead of DALI's
    portable: dict[str, int] | None = None

    def save(self, path: Path) -> None:
        from shardflow.atomic import write_atomic

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps({"version": VERSION, **asdict(self)}, indent=1) + "\n")
                     .encode())

    def choices(self, normalize: bool = False, dali: bool = True) -> dict[str, Any]:
        """The tuned options, for a loader with float (`normalize`) or uint8 output, running
        the DALI backend or (`dali` False) the portable one."""
        chosen = {"decode": self.device, "reader": self.reader, "threads": self.threads,
                  "prefetch": self.prefetch}
        if not dali and self.portable:
            chosen.update({k: v for k, v in self.portable.items() if k in ("threads",
                                                                           "prefetch")})
        if self.device == "gpu" and self.hw_decoder_load is not None:
            chosen["hw_decoder_load"] = self.hw_decoder_load
        resize_on = self.resize_on_float if normalize and self.resize_on_float else \
            self.resize_on
        if self.device == "cpu" and resize_on is not None:
            chosen["resize_on"] = resize_on
        return chosen


# Which tuned choices mean something to each loader (the figures are measured on images).
APPLIES_TO = {"image": ("decode", "reader", "threads", "prefetch", "hw_decoder_load",
                        "resize_on"),
              "pointcloud": ("decode", "reader", "threads", "prefetch"),
              "text": ("reader", "prefetch")}
AUTOMATIC = ("decode", "reader", "resize_on")  # options whose "auto" a tuned value replaces


def load(path: Path | None = None) -> Tuning | None:
    """The tuning file for this machine, or None (missing, unreadable, another machine)."""
    path = path or default_path()
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
        if doc.pop("version", None) != VERSION:
            raise ValueError("another version")
        tuning = Tuning(**doc)
        _check_fields(tuning)
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring tuning file %s: %s", path, exc)
        return None
    if tuning.machine != this_machine():
        log.info("ignoring tuning file %s: measured on %s, this is %s", path, tuning.machine,
                 this_machine())
        return None
    return tuning


def _check_fields(tuning: Tuning) -> None:
    """ValueError for a field of the wrong kind (a file edited by hand): a loader would
    otherwise take it as its own option and refuse it, or crash on it, at every build."""
    def positive_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    def where(value: Any) -> bool:
        return value in (None, "torch", "dali")

    problems = [name for name, ok in (
        ("device", tuning.device in ("auto", "cpu", "gpu")),
        ("reader", tuning.reader in ("auto", "dali", "stream", "index")),
        ("threads", positive_int(tuning.threads)), ("prefetch", positive_int(tuning.prefetch)),
        ("resize_on", where(tuning.resize_on)),
        ("resize_on_float", where(tuning.resize_on_float)),
        ("hw_decoder_load", tuning.hw_decoder_load is None or
         isinstance(tuning.hw_decoder_load, (int, float))),
        ("backend_split", isinstance(tuning.backend_split, list)),
        ("portable", tuning.portable is None or (isinstance(tuning.portable, dict) and all(
            positive_int(v) for v in tuning.portable.values())))) if not ok]
    if problems:
        raise ValueError(f"{', '.join(problems)}: not what --tune writes")


def apply(kind: str, options: dict[str, Any], path: Path | None, *, dali_readable: bool,
          dali: bool = True, stored_ids: bool = False, say: bool = True) -> dict[str, Any]:
    """`options` of a `kind` loader with the tuned choices filled in where the caller left
    them automatic and they are possible here (`dali_readable`: the source is local shards
    with .idx files; `dali`: the loader runs the DALI backend, not the portable one;
    `stored_ids`: text stored as token ids, which the index reader reads whatever was tuned;
    `say`: log the choices filled in)."""
    tuning = load(path)
    if tuning is None:
        return options
    tuned = dict(options)
    for name, value in tuning.choices(bool(options.get("normalize", False)), dali).items():
        if name not in APPLIES_TO.get(kind, ()):
            continue
        if not dali and (name, value) in _DALI_ONLY:
            continue  # measured with DALI; the portable backend streams and decodes on the CPU
        if name == "reader" and stored_ids:
            continue  # readers.pick_reader's choice, measured on these shards, not on images
        if not _possible(name, value, options, dali_readable, say):
            continue
        if name in AUTOMATIC and tuned.get(name, "auto") == "auto":
            tuned[name] = value
        elif name not in AUTOMATIC and name not in tuned:
            tuned[name] = value
    used = {k: v for k, v in tuned.items() if options.get(k) != v}
    if used and say:
        log.info("%s loader: %s from the tuning file %s (measured %s: %.0f images/s)", kind,
                 used, path or default_path(), tuning.measured, tuning.images_per_s)
    return tuned


_DALI_ONLY = {("reader", "dali"), ("decode", "gpu"), ("resize_on", "dali")}


def _possible(name: str, value: Any, options: dict[str, Any], dali_readable: bool,
              say: bool) -> bool:
    if name == "reader" and value == "dali" and not dali_readable:
        if say:
            log.info("tuning file says reader='dali', but these shards are remote or have no "
                     ".idx files: the streaming reader reads them")
        return False
    if name == "decode" and value == "gpu":
        return options.get("device", "auto") not in ("cpu",)
    return True


def source_and_options(kind: str, source: Any, options: dict[str, Any],
                       tuning_file: Path | None, use_tuning: bool) -> tuple[Any, dict[str, Any]]:
    """What every `*_loader` function does first: resolve `source` (refusing `pipe:` unless
    `allow_pipe`; with `storage_options` and `io_timeout_s` for its URLs), then fill in the
    tuned choices that apply to it."""
    from shardflow.loading.readers import dali_readable, resolve_backend
    from shardflow.loading.shardlist import resolve_source

    resolved = resolve_source(source, allow_pipe=bool(options.get("allow_pipe", False)),
                              storage_options=options.get("storage_options"),
                              index=options.get("index"),
                              io_timeout_s=options.get("io_timeout_s"))
    if use_tuning:
        dali = resolve_backend(options.get("backend", "auto"), kind) == "dali"
        options = apply(kind, options, tuning_file, dali_readable=dali_readable(resolved),
                        dali=dali, stored_ids=resolved.tokens is not None)
    return resolved, options
