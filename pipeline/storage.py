"""Where shards are written: a local folder or an object-store prefix (any fsspec URL), and
writing there so that a reader never sees a partial file under a final name.

    store = Store("s3://bucket/train", {"client_kwargs": {"endpoint_url": URL}})
    with store.staging() as folder:           # a local folder to write whole files in
        ...                                   # (the store's own folder when it is local)
        store.publish(folder, "train-000000.idx", "train-000000.tar")
    store.write_bytes("manifest.json", data)  # all or nothing
    store.names("*.tar"); store.exists(name); store.read_bytes(name); store.delete(name)

A local folder is written as before (atomic.py: a temporary file, fsynced, renamed). An object
store has no rename: a file is uploaded under a hidden temporary key (`.NAME.tmp`), moved to
its final key (a server-side copy, then the temporary key deleted), so a listing never shows a
final name whose object is partial; a killed upload leaves only the hidden key, which the next
run of the same job deletes (`names(".*.tmp")`).

Storage options (endpoint, credentials, profile, anonymous access) are fsspec's keyword
arguments for the store's file system. They are held here and handed to fsspec only: never
part of a repr, a message or anything written.

How long a server may keep us waiting is decided here too, once for every opener:
`with_timeouts(options, url)` adds a connect and a read timeout to the options of http(s)://
and s3:// URLs, and `timed(what, url, options)` turns a timeout met inside into a
StorageTimeout that names the URL, what was being done and the time waited.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from shardflow.atomic import write_atomic
from shardflow.urls import is_remote, redact, scrub

StorageOptions = Mapping[str, Any]  # fsspec's keyword arguments, e.g. {"anon": True}

# How long a server may keep us waiting: to connect, then without a byte mid-answer. A TCP
# and TLS handshake takes milliseconds; 10 s still covers three lost SYNs (resent after 1, 3
# and 7 s). An object store's first byte comes within a second or two, throttled or not;
# 30 s is ten times that, and a stall mid-epoch, tried RETRIES + 1 times, still fails well
# inside the loaders' 600 s without a batch (timeout_s), naming the URL. No total limit: a
# large shard on a slow link may take minutes, and is fine as long as bytes keep coming.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0
_KINDS = {"http": "http", "https": "http", "s3": "s3", "s3a": "s3"}  # whose timeouts we set


class StorageTimeout(TimeoutError):
    """A server that did not connect or answer in time; the message names the URL (redacted),
    what was being done and the time waited. A TimeoutError, so an OSError: the tools exit 3."""


def with_timeouts(options: StorageOptions | None, *urls: str, seconds: float | None = None
                  ) -> dict[str, Any]:
    """fsspec's `options` for `urls` with our connect and read timeouts, where the user set
    none: aiohttp's for http(s)://, botocore's for s3:// (other schemes, or URLs of both
    kinds, which no one set of options serves, are left as they are). `seconds`: the read
    timeout (None: READ_TIMEOUT_S); connecting gets CONNECT_TIMEOUT_S of it at most."""
    read = READ_TIMEOUT_S if seconds is None else seconds
    connect = min(CONNECT_TIMEOUT_S, read)
    out = dict(options or {})
    kinds = {_KINDS.get(urlsplit(u).scheme, "other") for u in urls if is_remote(u)}
    if kinds == {"http"} and "timeout" not in (out.get("client_kwargs") or {}):
        import aiohttp

        # sock_read: the longest silence while an answer (its headers too) is awaited
        timeout = aiohttp.ClientTimeout(sock_connect=connect, sock_read=read)
        out["client_kwargs"] = {**(out.get("client_kwargs") or {}), "timeout": timeout}
    elif kinds == {"s3"}:
        out["config_kwargs"] = {"connect_timeout": connect, "read_timeout": read,
                                **(out.get("config_kwargs") or {})}
    return out


def timeouts(options: StorageOptions | None) -> tuple[float | None, float | None]:
    """The connect and read timeouts `options` hold (ours or the user's); None: not known."""
    options = options or {}
    given = options.get("timeout") or (options.get("client_kwargs") or {}).get("timeout")
    if given is not None:  # aiohttp's, per request or per session
        return getattr(given, "sock_connect", None), getattr(given, "sock_read", None)
    config = options.get("config_kwargs") or {}
    return config.get("connect_timeout"), config.get("read_timeout")


def causes(exc: BaseException) -> list[BaseException]:
    """`exc` and the errors it was raised from (fsspec wraps a server's in its own); not
    past a `raise ... from None`, which says the error before is not its cause."""
    errors = [exc]
    while len(errors) < 8:
        last = errors[-1]
        before = last.__cause__ or (None if last.__suppress_context__ else last.__context__)
        if before is None:
            return errors
        errors.append(before)
    return errors


def _is_timeout(err: BaseException) -> bool:
    # asyncio's, aiohttp's and fsspec's are TimeoutErrors; botocore's and urllib3's are not
    return isinstance(err, TimeoutError) or "Timeout" in type(err).__name__


def timed_out(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is a timeout (fsspec's HTTP info
    raises FileNotFoundError for one: it is no answer that the file is missing)."""
    return any(_is_timeout(err) for err in causes(exc))


@contextlib.contextmanager
def timed(what: str, url: str, options: StorageOptions | None) -> Iterator[None]:
    """A timeout met inside raised again as StorageTimeout: `what` was being done ("reading
    shard"), to `url`, and how long it waited; other errors pass as they are (a DataError or
    a hung worker too: only the file system's OSErrors are its answers)."""
    start = time.monotonic()
    try:
        yield
    except StorageTimeout:
        raise
    except Exception as exc:
        if not isinstance(exc, OSError) or not timed_out(exc):
            raise
        raise StorageTimeout(_said(what, url, options, exc, time.monotonic() - start)) from exc


def _said(what: str, url: str, options: StorageOptions | None, exc: BaseException,
          waited: float) -> str:
    connect, read = timeouts(options)
    kinds = {_kind(err) for err in causes(exc) if _is_timeout(err)}
    if "connect" in kinds and connect is not None:
        how = f"no connection within {connect:g} s (the connect timeout)"
    elif "read" in kinds and read is not None:
        how = f"the server sent nothing for {read:g} s (the read timeout)"
    else:
        how = f"no answer after {waited:.1f} s"
    return f"{what} {redact(url)}: {how}; for a slow server, raise io_timeout_s (--timeout)"


def _kind(err: BaseException) -> str:
    # aiohttp: ConnectionTimeoutError, SocketTimeoutError; botocore: ConnectTimeoutError,
    # ReadTimeoutError
    name = type(err).__name__
    return "connect" if "Connect" in name else "read" if "Socket" in name or "Read" in name \
        else "other"


def check_storage_options(options: object, name: str = "storage_options") -> None:
    """TypeError unless `options` is None or a mapping with string keys (values are not shown:
    they may be secrets)."""
    if options is None:
        return
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise TypeError(f"{name} must be a dict of fsspec options with string keys, e.g. "
                        "{'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9000'}} (got a "
                        f"{type(options).__name__})")


class Store:
    """A local folder or an fsspec URL prefix to write shards, indexes, journals and
    manifests to, whole or not at all. `str(store)` names it with credentials redacted."""

    def __init__(self, location: str | Path, storage_options: StorageOptions | None = None
                 ) -> None:
        check_storage_options(storage_options)
        text = str(location)
        self.remote = is_remote(text)
        self.url = text.rstrip("/") if self.remote else str(Path(text.removeprefix("file://")))
        self._options = dict(storage_options or {})
        self._fs: Any = None
        self._root = ""

    def __str__(self) -> str:
        return redact(self.url)

    def __repr__(self) -> str:
        return f"Store({str(self)!r})"

    # -- where things are --------------------------------------------------------------------

    @property
    def folder(self) -> Path:
        """The local folder (a local store only)."""
        if self.remote:
            raise ValueError(f"{self} is not a local folder")
        return Path(self.url)

    def where(self, name: str) -> str:
        """`name`'s location for a message: a path, or a URL with credentials redacted."""
        return redact(f"{self.url}/{name}") if self.remote else str(self.folder / name)

    def holds(self, url: str) -> bool:
        """Whether `url` names a file directly in this store (however it is spelled)."""
        if not self.remote:
            return "://" not in url and Path(url).resolve().parent == self.folder.resolve()
        import fsspec

        path = fsspec.core.url_to_fs(url, **self._options)[1]
        return path.rstrip("/").rsplit("/", 1)[0] == self._fs_and_key("")[1].rstrip("/")

    def _fs_and_key(self, name: str) -> tuple[Any, str]:
        if self._fs is None:
            import fsspec

            self._fs, self._root = fsspec.core.url_to_fs(self.url, **self._options)
            self._root = self._root.rstrip("/")
        return self._fs, f"{self._root}/{name}"

    # -- reading -----------------------------------------------------------------------------

    def names(self, pattern: str = "*") -> list[str]:
        """Names of the files directly in the store that match the glob `pattern`, sorted."""
        if not self.remote:
            return sorted(p.name for p in self.folder.glob(pattern) if p.is_file())
        fs, key = self._fs_and_key(pattern)
        with self._naming(""):
            fs.invalidate_cache(self._root)  # another process (a killed run) may have written
            return sorted(found.rstrip("/").rsplit("/", 1)[-1] for found in fs.glob(key))

    def exists(self, name: str) -> bool:
        if not self.remote:
            return (self.folder / name).exists()
        fs, key = self._fs_and_key(name)
        with self._naming(name):
            fs.invalidate_cache(self._root)
            return bool(fs.exists(key))

    def read_bytes(self, name: str) -> bytes:
        if not self.remote:
            return (self.folder / name).read_bytes()
        fs, key = self._fs_and_key(name)
        with self._naming(name):
            return bytes(fs.cat_file(key))

    # -- writing, all or nothing ---------------------------------------------------------------

    def makedirs(self) -> None:
        """Create a local folder. An object store needs none (a missing bucket is an error
        at the first upload, never created here)."""
        if not self.remote:
            self.folder.mkdir(parents=True, exist_ok=True)

    def write_bytes(self, name: str, data: bytes) -> None:
        if not self.remote:
            write_atomic(self.folder / name, data)
            return
        fs, key = self._fs_and_key(name)
        temporary = self._fs_and_key(_temporary(name))[1]
        with self._naming(name):
            fs.pipe_file(temporary, data)
            fs.mv(temporary, key)

    def publish(self, folder: Path, *names: str) -> None:
        """Give files finished in `folder` (from `staging()`) their final names here, in the
        order given: nothing to do for a local store (they are already in place, renamed by
        their writer); uploaded under a temporary key, moved, then deleted from `folder` for
        an object store."""
        if not self.remote:
            return
        for name in names:
            fs, key = self._fs_and_key(name)
            temporary = self._fs_and_key(_temporary(name))[1]
            with self._naming(name):
                fs.put_file(str(folder / name), temporary)
                fs.mv(temporary, key)
            (folder / name).unlink()

    def delete(self, name: str) -> None:
        """Delete `name` if it is there."""
        if not self.remote:
            (self.folder / name).unlink(missing_ok=True)
            return
        fs, key = self._fs_and_key(name)
        with contextlib.suppress(FileNotFoundError), self._naming(name):
            fs.rm_file(key)

    @contextlib.contextmanager
    def _naming(self, name: str) -> Iterator[None]:
        """An OSError of the file system (a missing bucket, a refused request) raised again,
        of the same type where it can be, with the location in front of its message."""
        try:
            yield
        except OSError as err:
            text = f"{self.where(name) if name else self}: {scrub(str(err))}"
            try:
                located = type(err)(text)
            except Exception:  # noqa: BLE001 - a type that takes other arguments
                located = OSError(text)
            raise located from err

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A local folder to write whole files in before `publish`: the store's own folder
        when it is local, else a temporary one, removed at the end."""
        if not self.remote:
            self.makedirs()
            yield self.folder
            return
        with tempfile.TemporaryDirectory(prefix="shardflow-stage-") as folder:
            yield Path(folder)


def _temporary(name: str) -> str:
    return f".{name}.tmp"
