"""Worker faults in the shard tools: a worker process that hangs on an input (a server that
stops sending mid-file) or dies (killed, out of memory) ends the run with an error naming the
inputs in flight, within the configured timeout; nothing waits forever, no worker is left
behind, and no partial shard is left under a final name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, QuietHandler, http_server, jpeg_bytes, process_tree

from shardflow.executor import WorkerError, ordered_map


class _StallingHandler(QuietHandler):
    """Serves files; for `stall.jpg` sends the headers and a few bytes, then nothing until
    the test releases it (`release` is set), as a stuck server or a dead NFS mount would."""

    stalled = threading.Event()
    release = threading.Event()

    def do_GET(self) -> None:
        if not self.path.endswith("stall.jpg"):
            return super().do_GET()
        self.send_response(200)
        self.send_header("Content-Length", "50000")
        self.end_headers()
        self.wfile.write(b"\xff\xd8\xff" + bytes(97))
        self.wfile.flush()
        type(self).stalled.set()
        type(self).release.wait(120)
        return None


@pytest.fixture
def stalling(tmp_path: Path):
    """A CSV manifest of two local images and one served by a stalling 127.0.0.1 server."""
    _StallingHandler.stalled.clear()
    _StallingHandler.release.clear()
    for name in ("a", "b"):
        (tmp_path / f"{name}.jpg").write_bytes(jpeg_bytes(ord(name)))
    with http_server(tmp_path, _StallingHandler) as url:
        listing = tmp_path / "list.csv"
        listing.write_text(f"path,label\na.jpg,0\n{url}/stall.jpg,1\nb.jpg,0\n")
        try:
            yield listing
        finally:
            _StallingHandler.release.set()  # let the handler thread end before shutdown


def _make_shards(listing: Path, out: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(ROOT / "tools" / "make_shards.py"), "manifest", str(listing),
           str(out), "--workers", "2", "--quiet", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _no_partial_shards(out: Path) -> None:
    assert not list(out.glob("*.tar")) and not (out / "manifest.json").exists()


def test_a_hung_worker_is_named_within_the_timeout(stalling, tmp_path):
    proc = _make_shards(stalling, tmp_path / "out", "--worker-timeout", "3")
    assert _StallingHandler.stalled.wait(60), "no worker reached the stalling input"
    stalled_at = time.monotonic()
    workers = _workers(proc.pid)
    _, err = proc.communicate(timeout=120)  # the run must end by itself
    assert proc.returncode == 4, err
    assert "stall.jpg" in err and "no result for 3 s" in err and "hung" in err
    # Named after the 3 s it was given, not before, and long before the server lets go at
    # 120 s (the slack is for stopping the pool on a busy machine: a bound, not a speed).
    assert 2.5 <= time.monotonic() - stalled_at <= 3 + 30
    _no_partial_shards(tmp_path / "out")
    assert workers and not [pid for pid in workers if _alive(pid)], "a worker was left running"


def _workers(pid: int) -> list[int]:
    """The pool's workers: forked by the forkserver, so the run's grandchildren."""
    return [p for p in process_tree(pid)[1:] if _parent(p) != pid]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its exit status is left to collect


def test_a_killed_worker_is_named_and_the_run_ends(stalling, tmp_path):
    proc = _make_shards(stalling, tmp_path / "out", "--worker-timeout", "600")
    try:
        assert _StallingHandler.stalled.wait(60), "no worker reached the stalling input"
        workers = _workers(proc.pid)
        assert workers, "no worker processes found"
        for pid in workers:  # as the kernel's OOM killer would
            os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # failed: stop the run and every process it started
            for pid in process_tree(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 4, err
    assert "a worker process died" in err and "stall.jpg" in err
    _no_partial_shards(tmp_path / "out")


def test_worker_timeout_must_be_positive(tmp_path):
    proc = _make_shards(tmp_path / "none.csv", tmp_path / "out", "--worker-timeout", "nan")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--worker-timeout" in err


# -- the executor itself -------------------------------------------------------------------------

def _stall_on(item: int, stall: int) -> int:
    if item == stall:
        threading.Event().wait()  # forever: a read that never returns
    return item


def _die_on(item: int, die: int) -> int:
    if item == die:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    return item


def _pid_of(item: int, pause: float) -> tuple[int, int]:
    time.sleep(pause)  # work that takes time, so that the consumer has a chance to help
    return item, os.getpid()


def test_a_helping_consumer_takes_chunks_itself_and_the_order_holds():
    """helping: the calling process is one of the workers: it converts the next chunk while
    the oldest is not back, and the results still come in input order."""
    got = list(ordered_map(_pid_of, range(40), 0.01, 2, chunk=2, helping=True))
    assert [item for item, _ in got] == list(range(40))
    pids = {pid for _, pid in got}
    assert os.getpid() in pids and len(pids) == 2  # this process and one worker
    # one worker is this process, helping or not: no pool at all
    for helping in (False, True):
        assert {pid for _, pid in ordered_map(_pid_of, range(4), 0, 1, helping=helping)} \
            == {os.getpid()}


def test_closing_the_map_early_terminates_a_hung_worker():
    """A consumer that stops early (a data error under raise) must not wait on a hung
    worker: the map's close terminates the workers."""
    results = ordered_map(_stall_on, range(20), 5, 2, chunk=1, timeout_s=600)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    closer = threading.Thread(target=results.close, name="test-closer")
    closer.start()
    closer.join(120)
    assert not closer.is_alive(), "close() waited for the hung worker"


def test_a_dead_worker_is_a_worker_error_naming_the_inputs_in_flight():
    got = []
    with pytest.raises(WorkerError, match=r"died .* one of the inputs in flight: .*input3"):
        for item in ordered_map(_die_on, range(12), 3, 2, chunk=1,
                                describe=lambda i: f"input{i}"):
            got.append(item)
    assert got == list(range(len(got))) and 3 not in got


def test_a_timeout_beyond_what_a_wait_can_take_means_none():
    assert list(ordered_map(_stall_on, range(4), -1, 2, chunk=1, timeout_s=1e12)) == [0, 1, 2, 3]
