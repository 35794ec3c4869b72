"""Listing shards: what a source string names, and whether each named shard is there and
is a regular file, checked before any reading starts.

    list_shards("shards/train")          a folder's *.tar / *.tar.gz / *.tgz, sorted
    list_shards("s3://b/train-{000..099}.tar")   brace ranges and globs, any fsspec URL
    preflight(urls, source)              one error naming every missing shard

`storage_options` (fsspec's keyword arguments: endpoint, credentials) go to every fsspec call;
they are never shown.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec

from pipeline.errors import DataError
from pipeline.urls import check_scheme, expand_braces, is_remote, redact, scrub

SHARD_PATTERNS = ("*.tar", "*.tar.gz", "*.tgz")  # tarread gunzips a stream by its magic


def list_shards(src: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Shard URLs from a folder, a glob, a brace pattern, or a comma-free single URL."""
    check_scheme(src)
    local = Path(src)
    if "://" not in src and local.is_dir():
        return [str(p) for p in sorted(p for pattern in SHARD_PATTERNS
                                       for p in local.glob(pattern))]
    urls = []
    for url in expand_braces(src):
        urls.extend(_glob(url, storage_options) if any(c in url for c in "*?[") else [url])
    return urls


def _glob(url: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    found = sorted(fs.glob(path))
    return [fs.unstrip_protocol(p) if "://" in url else p for p in found]


def regular_file(path: str, samples: int | None = 1) -> None:
    """Refuse a local path that is a folder, FIFO, socket or device (links followed): opening
    a FIFO blocks until a writer comes, which may be never, and a device may never end.
    `samples`: what refusing it costs (a line file holds an unknown number: None)."""
    if path.startswith("file://"):
        path = path[len("file://"):]
    elif "://" in path:
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return  # the caller's open says so, in its own words
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) \
            else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise DataError("not-a-regular-file", f"the path is {kind}, not a regular file",
                        samples=samples)


def preflight(urls: list[str], source: str,
              storage_options: Mapping[str, Any] | None = None) -> None:
    """One error listing every missing shard (and one for a source that matches none)."""
    if not urls:
        raise FileNotFoundError(f"{scrub(source)}: no shards found")
    missing = _missing([u for u in urls if not u.startswith("pipe:")], storage_options)
    if missing:
        listed = ", ".join(redact(u) for u in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise FileNotFoundError(f"{len(missing)} of {len(urls)} shards are missing: "
                                f"{listed}{more}")
    special = [u for u in urls if not u.startswith("pipe:") and not _regular(u)]
    if special:
        raise ValueError(f"{len(special)} of {len(urls)} shards are not regular files (a FIFO "
                         "blocks its reader forever, a device may never end): "
                         + ", ".join(special[:20]))


def _regular(url: str) -> bool:
    """False for a local FIFO, socket or device (remote URLs pass; links are followed)."""
    try:
        regular_file(url)
    except DataError:
        return False
    return True


def _missing(urls: list[str], storage_options: Mapping[str, Any] | None) -> list[str]:
    """The URLs that name nothing. In object storage, one listing per folder rather than one
    request per shard (thousands of shards: thousands of round trips at start-up); over
    HTTP, which has no listing, the requests go out 16 at a time."""
    found: dict[str, bool] = {}
    by_folder: dict[str, list[str]] = {}
    web = [u for u in urls if u.startswith(("http://", "https://"))]
    for url in urls:
        if url in web:
            continue
        if not is_remote(url):
            found[url] = os.path.exists(url[len("file://"):] if url.startswith("file://")
                                        else url)
        else:
            by_folder.setdefault(url.rsplit("/", 1)[0], []).append(url)
    for folder, members in by_folder.items():
        found.update(_listed(folder, members, storage_options))
    if web:
        with ThreadPoolExecutor(max_workers=16) as pool:
            found.update(zip(web, pool.map(lambda u: _exists(u, storage_options), web),
                             strict=True))
    return [u for u in urls if not found[u]]


def _listed(folder: str, urls: list[str], storage_options: Mapping[str, Any] | None
            ) -> dict[str, bool]:
    fs, path = fsspec.core.url_to_fs(folder, **(storage_options or {}))
    try:
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    except FileNotFoundError:
        names = set()
    return {u: u.rsplit("/", 1)[-1] in names for u in urls}


def _exists(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return bool(fs.exists(path))


def count_from_index(url: str) -> int | None:
    if is_remote(url) or not url.endswith(".tar"):
        return None
    idx = Path(url[: -len(".tar")] + ".idx")
    if not idx.is_file():  # absent, or a FIFO that would block the open
        return None
    with open(idx) as f:
        head = f.readline().split()
    return int(head[1]) if len(head) == 2 and head[1].isdigit() else None
