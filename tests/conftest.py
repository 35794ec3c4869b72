"""Shared helpers: tiny real datasets written to temp dirs, the tools run as subprocesses,
and shards read back with webdataset and with DALI's own reader in CPU mode."""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.server
import importlib
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent

# Under pytest-xdist (`make test`: three workers on our two cores) each worker, and every tool
# it starts, runs torch on one thread: two or three processes whose OpenMP threads spin-wait
# for each other ran the suite 1.5x slower than one process (measured; tests/README.md).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def dali_available() -> bool:
    from shardflow.loading.readers import dali_importable

    return dali_importable()


def import_or_skip(name: str) -> Any:
    """pytest.importorskip, but a package that is installed and breaks on import skips too:
    PyPI's torchvision beside our CPU torch raises RuntimeError ("operator torchvision::nms
    does not exist"), and lightning imports it when it is there. Such a reference is optional
    (never a dependency), so its absence or breakage says nothing about our code."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure to import means "not usable here"
        pytest.skip(f"{name} does not import here ({type(e).__name__}: {str(e)[:120]})")


def needs_dali(item: pytest.Item) -> bool:
    """Marked `dali`, or parametrized (directly or through a parametrized fixture, under any
    name) with the value "dali" (DALI's reader or graph by name: reader="dali",
    backend="dali") or with decode="gpu" (DALI's mixed decode or graph on the GPU): such a
    test runs only where nvidia.dali imports."""
    params = getattr(item, "callspec", None)
    named = params.params if params is not None else {}
    return item.get_closest_marker("dali") is not None or any(
        value == "dali" or (name == "decode" and value == "gpu")
        for name, value in named.items() if isinstance(value, str))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: "not dali" sees the added marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that needs DALI by its parameters carries the `dali` marker, as one marked by
    # hand does: `pytest -m "gpu and not dali"` leaves it out on any machine. The no-DALI run
    # (PYTHONPATH=tests/nodali, see the Makefile) skips DALI's own tests.
    for item in items:
        if needs_dali(item) and item.get_closest_marker("dali") is None:
            item.add_marker(pytest.mark.dali)
    if not dali_available():
        no_dali = pytest.mark.skip(reason="needs nvidia.dali (it does not import here)")
        for item in items:
            if needs_dali(item):
                item.add_marker(no_dali)
    items.sort(key=longest_first)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id
            item.add_marker(skip)


def longest_first(item: pytest.Item) -> int:
    """The order tests are handed to xdist's workers in: the long ones (`slow`, `accuracy`,
    and the groups one worker runs in turn: docs, Ray, S3) first, so that no worker is
    left with a long test while the others wait at the end. A stable sort: the rest keeps
    pytest's order."""
    long = ("slow", "accuracy", "xdist_group")
    return 0 if any(item.get_closest_marker(name) for name in long) else 1


@pytest.fixture(autouse=True, scope="session")
def isolated_home(tmp_path_factory: pytest.TempPathFactory):
    """A fresh HOME for the whole session (and the tools it runs): a tuning file measured on
    this machine (~/.cache/shardflow/tuning.json) must not change what the tests build."""
    import os

    old = os.environ.get("HOME")
    os.environ["HOME"] = str(tmp_path_factory.mktemp("home"))
    yield
    if old is None:
        os.environ.pop("HOME", None)
    else:
        os.environ["HOME"] = old


# fsspec runs one event-loop thread per process for http(s) and other async filesystems; that
# loop's default executor runs its DNS lookups (s3fs): threads asyncio_0, asyncio_1, ...
LONG_LIVED_THREADS = {"fsspecIO"}
LONG_LIVED_PREFIXES = ("test-", "asyncio_")


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    """Fail a test that leaves a thread running (a loader, stage or fetcher not closed).
    Threads of the tests' own servers are named "test-..." and may outlive one test."""
    before = set(threading.enumerate())
    yield
    stray = [t for t in threading.enumerate() if t not in before and t.is_alive()
             and not t.name.startswith(LONG_LIVED_PREFIXES) and t.name not in LONG_LIVED_THREADS]
    for thread in stray:
        thread.join(timeout=5)  # a stage that is stopping gets a moment to finish
    stray = [t.name for t in stray if t.is_alive()]
    assert not stray, f"threads left running: {stray}"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; no request log on stderr."""

    def log_message(self, *args: object) -> None:
        pass


class RangeHandler(QuietHandler):
    """Also answers `Range: bytes=a-b` requests (206), as object stores and web servers do."""

    def do_GET(self) -> None:
        wanted = self.headers.get("Range", "")
        path = Path(self.translate_path(self.path))
        if not wanted.startswith("bytes=") or not path.is_file():
            return super().do_GET()
        data = path.read_bytes()
        first, _, last = wanted[len("bytes="):].partition("-")
        start, end = int(first or 0), min(int(last) + 1 if last else len(data), len(data))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        self.wfile.write(data[start:end])
        return None


@contextlib.contextmanager
def http_server(directory: Path, handler: type = QuietHandler) -> Iterator[str]:
    """`directory` served on 127.0.0.1 (a free port) for the block; yields the base URL."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="test-http")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def jpeg_bytes(seed: int, size: tuple[int, int] = (48, 40), mode: str = "RGB",
               fmt: str = "JPEG") -> bytes:
    """A small noisy image in any PIL mode and format (noise: decoding must do real work)."""
    rng = np.random.default_rng(seed)
    w, h = size
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
    out = io.BytesIO()
    img.save(out, format=fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return out.getvalue()


def make_image_folder(root: Path, classes: int = 3, per_class: int = 5) -> Path:
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            (folder / f"img{i:03d}.jpg").write_bytes(jpeg_bytes(c * 1000 + i))
    return root


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Image.Image]:
    """Six built-in photo-like JPEGs at 96 x 72, RGB: what the ops are checked on."""
    from shardflow.builtin import make_photo_corpus

    folder = make_photo_corpus(tmp_path_factory.mktemp("ops") / "photos", count=6)
    return [Image.open(f).convert("RGB").resize((96, 72)) for f in sorted(folder.rglob("*.jpg"))]


def photo_tensor(images: list[Image.Image]) -> Any:
    """uint8 (N, 3, H, W) of PIL images."""
    import torch

    return torch.stack([torch.from_numpy(np.array(p.convert("RGB"))).permute(2, 0, 1)
                        for p in images])


# -- what a GPU test shows with CUDA, counted on the CPU ----------------------------------------

# Every call that reads a tensor's value on the host (a device sync on a GPU), and an explicit
# synchronize. On the CPU nothing syncs, so the calls are counted instead.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
              "numpy")


def count_host_reads(monkeypatch: pytest.MonkeyPatch, counted: list[str],
                     allowed: tuple[Any, ...] = ()) -> None:
    """Record in `counted` each host read, except those made directly from the functions
    whose code objects are in `allowed`."""
    import torch

    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def counting(self, *args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            if sys._getframe(1).f_code not in allowed:
                counted.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a, **k: (counted.append("synchronize"), real_sync(*a, **k))[1]
                        if torch.cuda.is_available() else counted.append("synchronize"))


def count_host_copies(monkeypatch: pytest.MonkeyPatch, counted: list[str],
                      through: tuple[Any, ...]) -> None:
    """Record in `counted` each copy of host values to another device (Tensor.to, copy_,
    torch.tensor or as_tensor with a device) not made directly from the functions whose code
    objects are in `through`. On CUDA such a copy from pageable memory waits for the stream:
    a host sync that only the route through pinned memory (ops.base.on_device) avoids."""
    import torch

    def caller() -> Any:
        return sys._getframe(2).f_code

    real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

    def to(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = real_to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type != "cpu" and caller() not in through:
            counted.append(f"Tensor.to in {caller().co_name}")
        return out

    def copy_(self, src, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.device.type != "cpu" and src.device.type == "cpu" and caller() not in through:
            counted.append(f"Tensor.copy_ in {caller().co_name}")
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    for name in ("tensor", "as_tensor"):
        real = getattr(torch, name)

        def made(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu" and \
                    caller() not in through:
                counted.append(f"torch.{_name} in {caller().co_name}")
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, made)


def on_the_device_path(run: Any, *tensors: Any) -> list[str]:
    """What `run(*tensors)` does on a device that is not the CPU, without CUDA: the tensors
    are moved to "meta" (shapes and dtypes, no values) first, so every `device.type == "cpu"`
    branch takes the device's side, and reading a value raises. Returns the host reads (and
    what raised) and the host-to-device copies not made through ops.base.on_device (pinned,
    asynchronous on CUDA): each a host sync on a GPU. The CPU twin of a test under CUDA's
    sync debug mode."""
    import torch

    from shardflow.ops import base

    moved = [t.to(torch.device("meta")) for t in tensors]  # as a test copies before it counts
    found: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        count_host_reads(patch, found)
        count_host_copies(patch, found, (base.on_device.__code__,))
        try:
            run(*moved)
        except (RuntimeError, NotImplementedError) as e:  # a value read on "meta"
            found.append(f"raised {type(e).__name__}: {e}")
    return found


def copier_outputs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every tensor a loader's DeviceCopier hands out from now on (kept: no id is reused).
    On the CPU the copier hands its inputs back; here each is a new view of them, so that a
    batch holding the tensor it gave the copier, not the one it got back, is told apart."""
    from shardflow.loading.delivery import DeviceCopier

    out: list[Any] = []
    real_call, real_move = DeviceCopier.__call__, DeviceCopier.move

    def handed(tensors: Any) -> list[Any]:
        views = [None if t is None else t.view_as(t) for t in tensors]
        out.extend(views)
        return views

    def call(self, image, label):  # type: ignore[no-untyped-def]
        image, label, ready = real_call(self, image, label)
        return (*handed((image, label)), ready)

    def move(self, *tensors):  # type: ignore[no-untyped-def]
        moved, ready = real_move(self, *tensors)
        return tuple(handed(moved)), ready

    monkeypatch.setattr(DeviceCopier, "__call__", call)
    monkeypatch.setattr(DeviceCopier, "move", move)
    return out


def not_delivered(batch: Any, outputs: list[Any]) -> list[str]:
    """The fields of `batch` holding a tensor (in a list or dict too) that did not come out
    of the copier (`copier_outputs`): on a GPU it would stay in host memory. The CPU twin of
    a GPU test's `is_cuda` on every field."""
    import torch

    copied = {id(t) for t in outputs if t is not None}
    missing = []
    for name, value in vars(batch).items():
        values = value if isinstance(value, list) else \
            list(value.values()) if isinstance(value, dict) else [value]
        if any(isinstance(v, torch.Tensor) and id(v) not in copied for v in values):
            missing.append(name)
    return missing


def chi_square(counts: list[int]) -> float:
    """Pearson's statistic of `counts` against equal expected counts."""
    expected = sum(counts) / len(counts)
    return sum((c - expected) ** 2 / expected for c in counts)


def resumed_run(make, after: int = 2):  # type: ignore[no-untyped-def]
    """(head, rest, again): `after` batches of a loader from `make()`, its state saved (through
    JSON) and the batches it went on with; then those of a new loader given that state."""
    with make() as full:
        it = iter(full)
        head = [next(it) for _ in range(after)]
        state = json.loads(json.dumps(full.state_dict()))
        rest = list(it)
    with make() as resumed:
        resumed.load_state_dict(state)
        again = list(resumed)
    return head, rest, again


@pytest.fixture(scope="module")
def op_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 built-in images of 40 px in 10 classes, 8 a shard: what the ops tests load."""
    from shardflow.builtin import make_image_folder as builtin_folder

    root = tmp_path_factory.mktemp("opshards")
    src = builtin_folder(root / "src", per_class=4, size=40)
    run_tool("make_shards", "imagefolder", src, root / "out", "--max-count", 8, check=True)
    return root / "out"


# Commands run in a child of tests/toolserver.py, a process that imported them once: a new
# Python spends about a second on make_shards' imports and five on train's (torch, DALI,
# matplotlib), and the suite runs them hundreds of times. The others (the benchmarks, the GPU
# check, the tokenizer trainer, the demo) start as a new Python, as a user starts them.
FORKED = {"train", "make_shards", "verify_shards", "plot_run", "show_shards"}


def run_tool(name: str, *args: object, check: bool = False) -> subprocess.CompletedProcess[str]:
    """`python tools/NAME.py ARGS` (the command `shardflow` runs for it), its output captured;
    a run over 300 s raises subprocess.TimeoutExpired."""
    cmd = [sys.executable, str(ROOT / "tools" / f"{name}.py"), *map(str, args)]
    if name in FORKED:
        proc = ToolServer.get().run(f"shardflow.tools.{name}", cmd[1:], timeout=300)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


class ToolServer:
    """This test process's tests/toolserver.py, started at its first use, ended at exit."""

    _running: ToolServer | None = None

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "toolserver.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()
        atexit.register(self.close)

    @classmethod
    def get(cls) -> ToolServer:
        if cls._running is None or cls._running.proc.poll() is not None:
            cls._running = cls()
        return cls._running

    def run(self, module: str, argv: list[str], timeout: float
            ) -> subprocess.CompletedProcess[str]:
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"module": module, "script": argv[0], "argv": argv[1:],
                       "cwd": os.getcwd(), "env": dict(os.environ), "stdout": str(out),
                       "stderr": str(err), "timeout": timeout}
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            code = json.loads(self.proc.stdout.readline())["code"]
            if code == -signal.SIGALRM:
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
            return subprocess.CompletedProcess([sys.executable, *argv], code,
                                               out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def load_manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def shard_paths(out: Path) -> list[Path]:
    return [out / s["name"] for s in load_manifest(out)["shards"]]


def read_wds(out: Path) -> list[dict]:
    """Every sample, in shard order, read with the webdataset library."""
    import webdataset as wds

    urls = [str(p) for p in shard_paths(out)]
    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def read_dali(out: Path, exts: list[str]) -> list[list[bytes]]:
    """Every sample's members (as bytes, in `exts` order) read by DALI's webdataset reader on
    the CPU, using the .idx files beside the shards. Without DALI (the no-DALI run) the test
    is skipped here, after what it checked before."""
    pytest.importorskip("nvidia.dali", reason="DALI's own reader: nvidia.dali does not import")
    from nvidia.dali import fn, pipeline_def

    tars = [str(p) for p in shard_paths(out)]
    total = load_manifest(out)["total_samples"]

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def pipe():  # type: ignore[no-untyped-def]
        outs = fn.readers.webdataset(
            paths=tars, index_paths=[t[:-4] + ".idx" for t in tars], ext=exts,
            missing_component_behavior="error", random_shuffle=False, name="reader")
        return tuple(outs) if len(exts) > 1 else (outs,)

    p = pipe()
    p.build()
    samples = []
    for _ in range(total):
        outs = p.run()
        samples.append([np.array(o[0]).tobytes() for o in outs])
    return samples


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in the block after `seconds` (main thread only): a test of something
    that must not hang fails instead of hanging the suite."""

    fired = []

    def expired(signum: int, frame: object) -> None:
        fired.append(True)
        raise TimeoutError(f"still running after {seconds} s: hung")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if fired:  # the block went on: code under test caught the TimeoutError (except Exception)
        raise TimeoutError(f"blocked for {seconds} s, then went on: the code under test "
                           "caught the deadline's error")


def convert_killed(cfg: object, kill_at: int, spec_dir: Path,
                   patches: dict[str, object] | None = None) -> None:
    """Run convert(cfg) in a child process (tests/convert_killed.py) that SIGKILLs itself once
    `kill_at` samples are written; `patches` ("module.NAME": value) are set there first, as a
    test's monkeypatch is here."""
    spec = spec_dir / "killed-spec.pkl"
    spec.write_bytes(pickle.dumps({"cfg": cfg, "kill_at": kill_at, "patches": patches or {}}))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "convert_killed.py"), str(spec)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])


@pytest.fixture(scope="session")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel built from this checkout and installed alone into a folder
    (--no-deps --no-index: its dependencies are this venv's, no network); its `shardflow`
    is bin/shardflow there, run with PYTHONPATH set to the folder (tests/test_cli.py)."""
    work = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w",
                    str(work / "dist")], check=True, timeout=300, cwd=work)
    [wheel] = (work / "dist").glob("shardflow-*.whl")
    site = work / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, timeout=300, cwd=work)
    return site
