"""Checkpoints: atomic files in the run folder, the newest valid one found on restart.

`ckpt-00001200.pt` is written as `.ckpt-00001200.pt.tmp`, fsynced and renamed, so a kill or a
full disk never leaves a partial checkpoint under a final name; the last `keep` are kept.
Loading uses `torch.load(weights_only=True)` and never falls back: a checkpoint holding a
pickled object is refused. A damaged newest checkpoint is named and the previous one is used;
one made for another model or dataset is refused with what differs, before anything is loaded.
"""

from __future__ import annotations

import logging
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from shardflow.atomic import fsync_dir

log = logging.getLogger(__name__)
VERSION = 1
PREFIX = "ckpt-"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"{PREFIX}{step:08d}.pt"


def save(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` atomically as the checkpoint of `step`; drop all but the newest `keep`."""
    path = checkpoint_path(run_dir, step)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            _write(f, {"version": VERSION, "step": step, **state})
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"saving checkpoint step {step} to {run_dir} failed "
                      f"({exc.strerror}); no partial file was left and the previous checkpoints"
                      " are intact: free space and run the same command again to resume") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(run_dir)
    for old in sorted(run_dir.glob(f"{PREFIX}*.pt"))[:-keep]:
        old.unlink()
    return path


def _write(f: Any, state: dict[str, Any]) -> None:
    """torch.save into `f`, flushed and synced. A full disk surfaces from torch's zip writer
    either as the OSError or, when it strikes inside the archive, as a RuntimeError ("unexpected
    pos") raised while the OSError is handled: that one is the OSError too."""
    try:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    except RuntimeError as exc:
        cause = exc.__context__ or exc.__cause__
        if isinstance(cause, OSError):
            raise cause from exc
        raise


def remove_partial(run_dir: Path) -> None:
    """Delete temporary files of saves that never finished (never under a final name)."""
    for tmp in run_dir.glob(f".{PREFIX}*.pt.tmp"):
        tmp.unlink(missing_ok=True)


def load_newest(run_dir: Path, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """The newest loadable checkpoint made for `fingerprint` (None if there is none)."""
    for path in sorted(run_dir.glob(f"{PREFIX}*.pt"), reverse=True):
        state = _load(path)
        if state is None:
            continue
        _check_fingerprint(path, state.get("fingerprint", {}), fingerprint)
        log.info("resuming from %s (step %d)", path.name, state["step"])
        return state
    return None


def _load(path: Path) -> dict[str, Any] | None:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{path} holds objects that weights_only loading refuses ({exc}); "
                         "shardflow never unpickles arbitrary objects. Delete it if you did "
                         "not put it there") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as exc:
        log.warning("checkpoint %s is corrupt or truncated (%s); trying the previous one",
                    path.name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    if not isinstance(state, dict) or state.get("version") != VERSION:
        log.warning("checkpoint %s is not a shardflow checkpoint of version %d; skipped",
                    path.name, VERSION)
        return None
    return state


def _check_fingerprint(path: Path, saved: dict[str, Any], mine: dict[str, Any]) -> None:
    # Checkpoints once recorded the world size here; a run now resumes on any (elastic.py).
    differ = sorted(k for k in set(saved) | set(mine)
                    if saved.get(k) != mine.get(k) and k != "world_size")
    if differ:
        detail = "; ".join(f"{k}: {saved.get(k)!r} there, {mine.get(k)!r} here" for k in differ)
        raise ValueError(f"{path} was made for another run ({detail}). Use another --out "
                         "folder, or the same task, model and data as that run")
