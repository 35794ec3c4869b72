"""All-or-nothing files: a reader never sees a partial file under a final name.

Shards, manifests, journals, checkpoints, tuning files and tokenizers are all written this way:
to a hidden temporary name beside the target, flushed and fsynced, then renamed over it (a
rename within one folder is atomic on POSIX file systems), and the folder fsynced where the
rename itself must survive a power cut.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the renames inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file, fsync and rename: all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
