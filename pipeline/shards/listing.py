"""Listing shards: what a source string names, and whether each named shard is there and
is a regular file, checked before any reading starts.

    list_shards("shards/train")          a folder's *.tar / *.tar.gz / *.tgz, sorted
    list_shards("s3://b/train-{000..099}.tar")   brace ranges and globs, any fsspec URL
    preflight(urls, source)              one error naming every missing shard (or every
                                         unreachable one, after the fetcher's retries)

`storage_options` (fsspec's keyword arguments: endpoint, credentials) go to every fsspec call;
they are never shown. A server that does not answer within their timeouts (storage.py) fails
the check at once, naming the URL (StorageTimeout); other transient errors are tried again.
"""

from __future__ import annotations

import email.utils
import logging
import os
import stat
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec

from shardflow import urls as url_policy
from shardflow.errors import DataError
from shardflow.storage import StorageTimeout, causes, timed, timed_out
from shardflow.urls import check_scheme, expand_braces, is_remote, redact, scrub

log = logging.getLogger(__name__)

SHARD_PATTERNS = ("*.tar", "*.tar.gz", "*.tgz")  # tarread gunzips a stream by its magic
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


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


def unlisted(src: str, urls: list[str]) -> list[DataError]:
    """A local folder's files that only their case keeps from being listed (`A.TAR`): no
    loader would read them, so index, verify and the loaders name them."""
    if "://" in src or not Path(src).is_dir():
        return []
    listed = {Path(u).name for u in urls}
    found = [p for p in sorted(Path(src).iterdir())
             if p.name.lower().endswith(SHARD_SUFFIXES) and p.name not in listed
             and not p.is_dir()]
    return [DataError("unlisted-shard", "the loaders list .tar, .tar.gz and .tgz files, in "
                      f"lower case: none would read it; rename it to {_lowered(p.name)}",
                      source=str(p)) for p in found]


def _lowered(name: str) -> str:
    """`A.TAR` -> `A.tar`: the name with its shard suffix in lower case."""
    suffix = next(s for s in SHARD_SUFFIXES if name.lower().endswith(s))
    return name[: -len(suffix)] + suffix


def _glob(url: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    with timed("listing", url, storage_options):
        found = sorted(fs.glob(path))
    return [fs.unstrip_protocol(p) if "://" in url else p for p in found]


def exists(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether `url` names a file; StorageTimeout when its server does not answer in time
    (fsspec's HTTP exists says False for that, as for any failure: asked to be strict, it
    raises them, and all but a timeout still mean "not there")."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    web = url.startswith(("http://", "https://"))
    with timed("looking for", url, storage_options):
        try:
            return bool(fs.exists(path, strict=True) if web else fs.exists(path))
        except Exception as exc:
            if not web or timed_out(exc):
                raise
            return False


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
    """One error listing every missing shard, or every unreachable one (a 5xx or a reset on
    each of the streaming reader's tries), and one for a source that matches none; a timeout
    is raised at once (StorageTimeout, naming the shard)."""
    if not urls:
        raise FileNotFoundError(f"{scrub(source)}: no shards found")
    found = _found([u for u in urls if not u.startswith("pipe:")], storage_options)
    missing = [u for u, there in found.items() if there is False]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {len(urls)} shards are missing: "
                                f"{_listing(missing)}")
    unreachable = {u: why for u, why in found.items() if isinstance(why, str)}
    if unreachable:
        reasons = ", ".join(sorted(set(unreachable.values())))
        raise ConnectionError(f"{len(unreachable)} of {len(urls)} shards are unreachable "
                              f"({reasons}): {_listing(list(unreachable))}")
    special = [u for u in urls if not u.startswith("pipe:") and not _regular(u)]
    if special:
        raise ValueError(f"{len(special)} of {len(urls)} shards are not regular files (a FIFO "
                         "blocks its reader forever, a device may never end): "
                         + ", ".join(special[:20]))


def _listing(urls: list[str]) -> str:
    more = f" and {len(urls) - 20} more" if len(urls) > 20 else ""
    return ", ".join(redact(u) for u in urls[:20]) + more


def _regular(url: str) -> bool:
    """False for a local FIFO, socket or device (remote URLs pass; links are followed)."""
    try:
        regular_file(url)
    except DataError:
        return False
    return True


def _found(urls: list[str], storage_options: Mapping[str, Any] | None
           ) -> dict[str, bool | str]:
    """Per URL: True (there), False (names nothing) or why it could not be reached. In object
    storage, one listing per folder rather than one request per shard (thousands of shards:
    thousands of round trips at start-up); over HTTP, which has no listing, the requests go
    out 16 at a time."""
    found: dict[str, bool | str] = {}
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
    return {u: found[u] for u in urls}


def _listed(folder: str, urls: list[str], storage_options: Mapping[str, Any] | None
            ) -> dict[str, bool | str]:
    fs, path = fsspec.core.url_to_fs(folder, **(storage_options or {}))
    try:
        listing = _retried("listing", folder, lambda: fs.ls(path, detail=False),
                           storage_options)
    except StorageTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - no such folder, or every try failed
        answer = _answer(exc)
        if answer is not False:
            return dict.fromkeys(urls, answer)
        listing = []
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in listing}
    return {u: u.rsplit("/", 1)[-1] in names for u in urls}


def _exists(url: str, storage_options: Mapping[str, Any] | None) -> bool | str:
    """fs.info, not fs.exists: fsspec's HTTP exists says False for a 503 or a reset, which
    would report a shard that is there, behind a hiccup, as missing."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    try:
        _retried("checking", url, lambda: fs.info(path), storage_options)
    except StorageTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - an answer (404), or every try failed
        return _answer(exc)
    return True


def _answer(exc: BaseException) -> bool | str:
    """False when the error says the object is not there (404, or a local FileNotFoundError);
    else why it could not be reached (fsspec's HTTP info wraps every failure, a 503 or a
    reset too, in a FileNotFoundError: its cause tells them apart)."""
    status = _status(exc)
    if status == 404 or (status is None and isinstance(exc, FileNotFoundError)
                         and not transient(exc)):
        return False
    return f"{_why(exc)} after {url_policy.RETRIES + 1} tries" if transient(exc) else _why(exc)


def _retried(doing: str, url: str, call: Any, storage_options: Mapping[str, Any] | None
             ) -> Any:
    """`call()`, tried again after a transient error with the streaming reader's back-off
    (pipeline/urls.py: RETRIES further tries, BACKOFF_S doubled each time, or what a 429 or
    503 asks in Retry-After). A timeout is not: the server had all of the read timeout to
    answer, and a start-up that waited RETRIES times as long would say the same, only later.
    It is raised as StorageTimeout (`doing` `url`: "checking https://...")."""
    for failures in range(url_policy.RETRIES + 1):
        try:
            with timed(doing, url, storage_options):
                return call()
        except StorageTimeout:
            raise
        except Exception as exc:
            if failures == url_policy.RETRIES or not transient(exc):
                raise
            wait = retry_wait(exc, failures, url_policy.BACKOFF_S)
            log.warning("%s %s failed (%s); try %d of %d in %.1f s", doing, redact(url),
                        _why(exc), failures + 2, url_policy.RETRIES + 1, wait)
            time.sleep(wait)
    raise AssertionError("not reached: the last try returns or raises")


def retry_wait(exc: BaseException, failures: int, backoff_s: float) -> float:
    """Seconds to wait after `exc`, the try that failed after `failures` others: what a 429
    or 503 asks in Retry-After (at most urls.RETRY_AFTER_MAX_S), else `backoff_s` doubled
    for each earlier failure."""
    asked = retry_after(exc)
    return backoff_s * 2 ** failures if asked is None else asked


def retry_after(exc: BaseException) -> float | None:
    """The wait a 429 or 503 asks for (Retry-After: seconds, or an HTTP date), capped."""
    for err in causes(exc):
        if getattr(err, "status", None) in (429, 503):
            value = (getattr(err, "headers", None) or {}).get("Retry-After")
            return None if value is None else _seconds(str(value))
    return None


def _seconds(value: str) -> float | None:
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None  # neither form: our own back-off
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = (when - datetime.now(timezone.utc)).total_seconds()
    return min(seconds if seconds >= 0 else 0.0, url_policy.RETRY_AFTER_MAX_S)  # NaN: 0


def transient(exc: BaseException) -> bool:
    """A server error (5xx), too many requests (429), a reset, a refused connection or a
    timeout, here or as the cause of the error fsspec raised: worth another try. A 404 or a
    403 is an answer."""
    status = _status(exc)
    if status is not None:
        return status >= 500 or status == 429
    return any(isinstance(err, ConnectionError | TimeoutError)
               or any(word in type(err).__name__ for word in ("Connection", "Timeout",
                                                              "Disconnect"))
               for err in causes(exc))


def _status(exc: BaseException) -> int | None:
    for err in causes(exc):
        status = getattr(err, "status", None)
        if isinstance(status, int):
            return status
    return None


def _why(exc: BaseException) -> str:
    status = _status(exc)
    return f"HTTP {status}" if status is not None else type(causes(exc)[-1]).__name__


def count_from_index(url: str) -> int | None:
    if is_remote(url) or not url.endswith(".tar"):
        return None
    idx = Path(url[: -len(".tar")] + ".idx")
    if not idx.is_file():  # absent, or a FIFO that would block the open
        return None
    with open(idx) as f:
        head = f.readline().split()
    return int(head[1]) if len(head) == 2 and head[1].isdigit() else None
