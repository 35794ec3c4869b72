"""Servers that stall or ask us to wait, on 127.0.0.1, started and stopped by each test. A
server that accepts connections and never answers fails the loader build, ShardDataset and
`shardflow verify`, `index` and `convert` within the timeout (plus what the start-up checks
add, bounded), naming the URL and the time waited; the tools exit 3. A 429 with Retry-After
is waited out as long as it asks, at start-up and mid-epoch, and every sample is read."""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import webdataset as wds
from conftest import RangeHandler, http_server
from PIL import Image

from shardflow import ShardDataset, image_loader

TIMEOUT = 2  # seconds: io_timeout_s, --timeout
# A correctness bound, not a speed one: the timeout, the checks' second request (fsspec's
# HEAD then GET), a tool's start, with room to spare on a busy machine.
BOUND = 25
OPTS = {"size": 32, "threads": 1, "shuffle_buffer": 16}
PATTERN = "a-{000000..000001}.tar"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two shards of four labelled JPEGs, written by webdataset's own TarWriter."""
    folder = tmp_path_factory.mktemp("timeouts")
    for shard in range(2):
        with wds.TarWriter(str(folder / f"a-{shard:06d}.tar")) as sink:
            for i in range(4):
                image = Image.new("RGB", (40, 32), (60 * i, 40 * shard, 90))
                jpeg = io.BytesIO()
                image.save(jpeg, format="JPEG")
                sink.write({"__key__": f"s{shard}_{i}", "jpg": jpeg.getvalue(),
                            "cls": str(i % 2).encode()})
    return folder


@contextlib.contextmanager
def stalled() -> Iterator[str]:
    """A server that accepts every connection and never sends a byte; its base URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True, name="test-stalled")
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()
        for conn in held:
            conn.close()


def failure_of(call: Callable[[], object]) -> tuple[BaseException, float]:
    """What `call()` raises and after how long; the test fails, rather than hangs, when it has
    not ended within BOUND seconds (the stalled server's close then ends it)."""
    outcome: dict[str, object] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome["error"] = err
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True, name="test-call")
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive(), f"still waiting after {BOUND} s"
    assert "error" in outcome, "it did not fail"
    return outcome["error"], outcome["seconds"]  # type: ignore[return-value]


def names_the_wait(message: str, base: str) -> None:
    assert base.removeprefix("http://") in message, message  # the URL
    assert f"sent nothing for {TIMEOUT} s" in message, message  # the time waited


@pytest.mark.backend
def test_a_stalled_server_fails_the_loader_build_within_the_timeout(shards):
    with stalled() as base:
        err, seconds = failure_of(lambda: image_loader(
            f"{base}/shards/{PATTERN}", batch_size=4, device="cpu", io_timeout_s=TIMEOUT,
            **OPTS))
    assert isinstance(err, TimeoutError), repr(err)
    names_the_wait(str(err), base)
    assert seconds < BOUND


def test_a_stalled_server_fails_shard_dataset_within_the_timeout(shards):
    with stalled() as base:
        err, seconds = failure_of(lambda: ShardDataset(f"{base}/shards/{PATTERN}",
                                                       io_timeout_s=TIMEOUT))
    assert isinstance(err, TimeoutError), repr(err)
    names_the_wait(str(err), base)
    assert seconds < BOUND


@pytest.mark.slow
@pytest.mark.parametrize("command", ["verify", "index", "convert"])
def test_a_stalled_server_stops_the_tools_with_exit_3(command, tmp_path):
    with stalled() as base:
        url = f"{base}/shards/{PATTERN}"
        args = {"verify": ["verify", url], "index": ["index", url, "--out", tmp_path / "idx"],
                "convert": ["convert", "shards", url, tmp_path / "out", "--workers", "1"]}
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "shardflow", *map(str, args[command]),
                               "--timeout", str(TIMEOUT), "--quiet"],
                              capture_output=True, text=True, timeout=BOUND + 30)
        seconds = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr
    names_the_wait(proc.stderr, base)
    assert seconds < BOUND


class AskToWait(RangeHandler):
    """Per shard, 429 with Retry-After: 1 for its first two requests (the start-up check's
    HEAD and the GET fsspec tries next) and for its first range request (the streaming
    reader's first read); each request is logged with its time and answer."""

    lock = threading.Lock()
    seen: dict[str, int] = {}
    ranged: set[str] = set()
    log: list[tuple[float, str, str, int]] = []  # time, shard, method, status

    def _answer(self, serve: Callable[[], object]) -> None:
        name = self.path.rsplit("/", 1)[-1]
        if not name.endswith(".tar"):
            serve()
            return
        with self.lock:
            self.seen[name] = self.seen.get(name, 0) + 1
            wait = self.seen[name] <= 2 or ("Range" in self.headers and name not in self.ranged)
            if wait and self.seen[name] > 2:
                self.ranged.add(name)
            self.log.append((time.monotonic(), name, self.command, 429 if wait else 200))
        if not wait:
            serve()
            return
        self.send_response(429)
        self.send_header("Retry-After", "1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:
        self._answer(super().do_HEAD)

    def do_GET(self) -> None:
        self._answer(super().do_GET)


@pytest.mark.backend
def test_retry_after_is_waited_out_and_every_sample_read(shards):
    handler = type("AskToWaitNow", (AskToWait,), {"seen": {}, "ranged": set(), "log": []})
    with http_server(shards, handler) as base:
        with image_loader(f"{base}/{PATTERN}", batch_size=4, train=False, device="cpu",
                          io_timeout_s=TIMEOUT, **OPTS) as loader:
            keys = sorted(k for batch in loader for k in batch.keys)
    assert keys == sorted(f"s{shard}_{i}" for shard in range(2) for i in range(4))
    for shard in ("a-000000.tar", "a-000001.tar"):
        times = [(t, status) for t, name, _, status in handler.log if name == shard]
        asked = [i for i, (_, status) in enumerate(times) if status == 429]
        assert asked[:2] == [0, 1] and len(asked) == 3, handler.log  # both retries were met
        for i in (1, asked[2]):  # after the check's GET, after the first read: our retries
            assert times[i + 1][0] - times[i][0] >= 0.95, handler.log  # our own back-off: 0.5


class SilentReads(RangeHandler):
    """Answers HEAD (the start-up check, fsspec's open), but a range request for a shard's
    bytes gets no answer until the test ends; counts those, per shard."""

    reads: dict[str, int] = {}
    lock = threading.Lock()
    done = threading.Event()

    def do_GET(self) -> None:
        if "Range" not in self.headers or not self.path.endswith(".tar"):
            super().do_GET()
            return
        with self.lock:
            name = self.path.rsplit("/", 1)[-1]
            self.reads[name] = self.reads.get(name, 0) + 1
        self.done.wait(BOUND + 30)


@pytest.mark.backend
def test_a_stall_mid_epoch_is_retried_then_fails_naming_the_shard(shards, monkeypatch):
    from shardflow.errors import DataError
    from shardflow.loading import fetch

    monkeypatch.setattr(fetch, "BACKOFF_S", 0.01)  # the tries, not the back-off, are shown
    handler = type("SilentReadsNow", (SilentReads,), {"reads": {}, "done": threading.Event()})
    with http_server(shards, handler) as base:
        try:
            loader = image_loader(f"{base}/{PATTERN}", batch_size=4, train=False,
                                  device="cpu", io_timeout_s=1, shards_in_flight=1, **OPTS)
            err, seconds = failure_of(lambda: [batch for batch in loader])
            loader.close()
        finally:
            handler.done.set()
    assert isinstance(err, DataError) and err.reason == "fetch-failed", repr(err)
    assert f"{base}/a-000000.tar" in str(err) and "failed 4 times" in str(err), str(err)
    assert "sent nothing for 1 s" in str(err), str(err)
    assert handler.reads["a-000000.tar"] == 4 and seconds < BOUND  # the next may have begun


def test_a_users_own_timeout_wins_s3_gets_botocores_and_other_schemes_none():
    import aiohttp

    from shardflow.storage import with_timeouts

    own = aiohttp.ClientTimeout(total=5)
    given = {"client_kwargs": {"timeout": own}}
    assert with_timeouts(given, "https://h/a.tar")["client_kwargs"]["timeout"] is own
    http = with_timeouts({"client_kwargs": {"headers": {"x": "1"}}}, "https://h/a.tar",
                         seconds=4)
    timeout = http["client_kwargs"]["timeout"]
    assert http["client_kwargs"]["headers"] == {"x": "1"}  # the user's options kept
    assert (timeout.sock_connect, timeout.sock_read, timeout.total) == (4, 4, None)
    s3 = with_timeouts({"config_kwargs": {"read_timeout": 99}}, "s3://b/a.tar")
    assert s3["config_kwargs"] == {"connect_timeout": 10, "read_timeout": 99}
    # no one set of options serves both kinds; a local path needs none
    assert with_timeouts({}, "gs://b/a.tar") == with_timeouts({}, "s3://b", "https://h") == {}
    assert with_timeouts(None, "shards/a.tar") == {}


def test_retry_after_in_seconds_or_as_a_date_is_capped_else_our_back_off():
    from datetime import datetime, timedelta, timezone
    from email.utils import format_datetime

    from shardflow.shards.listing import retry_wait

    class Answer(Exception):
        def __init__(self, status: int, after: str) -> None:
            self.status, self.headers = status, {"Retry-After": after}

    assert retry_wait(Answer(429, "3"), 0, 0.5) == 3
    assert retry_wait(Answer(503, "3600"), 0, 0.5) == 60  # capped
    soon = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=30), usegmt=True)
    assert 25 < retry_wait(Answer(503, soon), 0, 0.5) <= 30
    try:  # as fsspec's HTTP info wraps the answer
        raise FileNotFoundError("https://h/a.tar") from Answer(429, "2")
    except FileNotFoundError as wrapped:
        assert retry_wait(wrapped, 0, 0.5) == 2
    assert retry_wait(Answer(500, "3"), 2, 0.5) == 2.0  # not a 429 or 503: ours, doubled
    assert retry_wait(Answer(429, "soon"), 1, 0.5) == 1.0  # unreadable: ours


def test_only_a_file_systems_timeout_becomes_a_storage_timeout():
    """A hung worker (WorkerError, raised `from None` in the executor's wait for a result)
    keeps its own exit code: the TimeoutError before it is not its cause."""
    import aiohttp
    from fsspec.exceptions import FSTimeoutError

    from shardflow.executor import WorkerError
    from shardflow.storage import StorageTimeout, timed, with_timeouts

    options = with_timeouts({}, "https://h/a.tar", seconds=3)
    with pytest.raises(WorkerError), timed("listing", "https://h/a.tar", options):
        try:
            raise TimeoutError
        except TimeoutError:
            raise WorkerError("no result for 3 s: hung") from None
    with pytest.raises(StorageTimeout, match=r"reading shard https://\*\*\*@h/a.tar: the "
                       r"server sent nothing for 3 s"), \
            timed("reading shard", "https://user:pw@h/a.tar", options):
        try:
            raise aiohttp.SocketTimeoutError("Timeout on reading data from socket")
        except aiohttp.SocketTimeoutError as err:
            raise FSTimeoutError from err
