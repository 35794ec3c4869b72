"""A bounded local cache of remote shards, shared by the processes of one machine.

    cache = ShardCache("/local/ssd/shardflow-cache", limit=200 * 2**30)
    path = cache.lookup(spec)          # a complete cached copy, or None
    writer = cache.writer(spec)        # fill it while the shard streams in
    writer.write(chunk) ...; writer.commit()    # or writer.abort()

A shard is cached under a name drawn from its URL (credentials and query string left out) and,
when manifest.json gives one, its sha256: a dataset rewritten under the same names gets new
cache entries. A copy is written under a temporary name and renamed into place only once it is
whole and its sha256 matches the manifest's (a mismatch is not cached, and logged), so no
process ever reads a partial copy; the rename is atomic, so processes (the ranks of a node)
may fill and read the cache at once, at worst fetching a shard twice. Least recently used
entries (by modification time, touched on every hit) are removed until the total is under
`limit`; a reader that still has an evicted file open keeps reading it (POSIX). A shard larger
than the whole limit is not cached. Temporary files of processes that died are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import uuid
from pathlib import Path

from shardflow.loading.shardlist import ShardSpec
from shardflow.urls import redact

log = logging.getLogger(__name__)
SUFFIX = ".tar"


class ShardCache:
    def __init__(self, root: str | Path, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"cache_limit={limit!r}: a number of bytes > 0")
        self.root, self.limit = Path(root), limit
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_orphans()

    def path_for(self, spec: ShardSpec) -> Path:
        ident = f"{redact(spec.url).split('?', 1)[0]}\n{spec.sha256 or ''}"
        digest = hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()
        name = redact(spec.url).split("?", 1)[0].rsplit("/", 1)[-1][:60]
        return self.root / f"{digest}-{_safe(name)}{'' if name.endswith(SUFFIX) else SUFFIX}"

    def lookup(self, spec: ShardSpec) -> Path | None:
        path = self.path_for(spec)
        try:
            os.utime(path)  # most recently used now
        except FileNotFoundError:
            return None
        return path

    def writer(self, spec: ShardSpec) -> CacheWriter:
        return CacheWriter(self, spec)

    def entries(self) -> list[os.DirEntry[str]]:
        with os.scandir(self.root) as it:
            return [e for e in it if e.is_file() and not e.name.startswith(".")]

    def size(self) -> int:
        return sum(_size(e) for e in self.entries())

    def evict(self, keep: Path | None = None) -> None:
        """Remove the least recently used entries until the total is within the limit."""
        entries = sorted(self.entries(), key=_mtime)
        total = sum(_size(e) for e in entries)
        for entry in entries:
            if total <= self.limit:
                break
            if keep is not None and entry.path == str(keep):
                continue
            with contextlib.suppress(FileNotFoundError):  # another process was first
                os.unlink(entry.path)
            total -= _size(entry)

    def _remove_orphans(self) -> None:
        """Temporary files (`.NAME.PID.ID.part`) whose process is gone."""
        with os.scandir(self.root) as it:
            for entry in it:
                if not (entry.name.startswith(".") and entry.name.endswith(".part")):
                    continue
                pid = entry.name.rsplit(".", 3)[-3]
                if pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)


class CacheWriter:
    """One shard's copy on its way into the cache (see the module docstring)."""

    def __init__(self, cache: ShardCache, spec: ShardSpec) -> None:
        self.cache, self.spec = cache, spec
        self.final = cache.path_for(spec)
        self.tmp = cache.root / f".{self.final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed by commit/abort
        self.hash = hashlib.sha256()
        self.written = 0

    def write(self, chunk: bytes) -> None:
        """The shard's next bytes (a fetch retried after a break continues where it broke,
        so the chunks arrive in order)."""
        if self.file is None:
            return
        self.file.write(chunk)
        self.hash.update(chunk)
        self.written += len(chunk)
        if self.written > self.cache.limit:  # larger than the whole cache: not cached
            self.abort()

    def commit(self) -> bool:
        """Rename the whole copy into place; False (and nothing cached) on a sha256 mismatch."""
        if self.file is None:
            return False
        self.file.close()
        self.file = None  # type: ignore[assignment]
        if self.spec.sha256 and self.hash.hexdigest() != self.spec.sha256:
            log.warning("%s: its bytes do not match manifest.json's sha256; not cached",
                        redact(self.spec.url))
            self.tmp.unlink(missing_ok=True)
            return False
        os.replace(self.tmp, self.final)
        self.cache.evict(keep=self.final)
        return True

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None  # type: ignore[assignment]
        self.tmp.unlink(missing_ok=True)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _size(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
