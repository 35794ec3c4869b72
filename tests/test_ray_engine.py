"""make_shards --engine ray: the conversion's workers as Ray tasks write the local engine's
bytes (every shard, .idx and the manifest), for images, text, point clouds, re-sharded shards
and Parquet rows; also when a worker dies and its task runs again, under --on-error skip and
raise, and when a run stopped half way is finished by either engine. A hung or lost task is a
WorkerError naming its inputs; without Ray the error says what to install.

One local Ray of 2 CPUs serves the module: `convert` finds it connected and uses it, and the
command-line test joins it by its address; one command-line run starts (and stops) its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import convert_killed, deadline, jpeg_bytes, make_image_folder, run_tool

from shardflow.builtin import make_pointcloud_folder, make_text_corpus
from shardflow.convert import ConvertConfig, convert, engine_ray, job
from shardflow.convert.parquet import ParquetOptions
from shardflow.errors import DataError
from shardflow.executor import WorkerError

# Ray starts in seconds, two command-line runs connect to it; one worker runs the module,
# so that one Ray serves every test (pytest-xdist's loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray for the module (workers warmed up, so that no test pays their start);
    yields its address for the command line."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=False)
    try:
        ray.get([ray.remote(lambda: os.getpid()).remote() for _ in range(2)])
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def by_both(tmp_path: Path, kind: str, src: Path | str, **options: object) -> tuple[Path, Path]:
    """The conversion by the local engine, then by Ray, into the same folder (its name is in
    the manifest); returns the local result (moved aside) and Ray's."""
    out = tmp_path / "out"
    convert(ConvertConfig(kind, str(src), str(out), workers=1, **options))  # type: ignore[arg-type]
    local = out.rename(tmp_path / "local")
    convert(ConvertConfig(kind, str(src), str(out), workers=2, engine="ray",  # type: ignore[arg-type]
                          **options))
    return local, out


def assert_same(local: Path, ray_out: Path, shards: int) -> None:
    assert sum(n.endswith(".tar") for n in files(local)) >= shards  # the test cuts shards
    assert files(ray_out) == files(local)


def image_folder(root: Path) -> Path:
    src = make_image_folder(root, classes=3, per_class=5)
    (src / "class1" / "extra.png").write_bytes(jpeg_bytes(7, fmt="PNG"))
    (src / "class2" / "cmyk.jpg").write_bytes(jpeg_bytes(8, mode="CMYK"))  # repaired
    return src


def parquet_file(root: Path) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root.mkdir()
    table = pa.table({"img": pa.array([jpeg_bytes(i, size=(24, 16)) for i in range(13)]),
                      "y": pa.array([f"c{i % 3}" for i in range(13)])})
    pq.write_table(table, root / "data.parquet", row_group_size=4)
    return root / "data.parquet"


SOURCES = {
    "imagefolder": (image_folder, {"max_count": 4, "shuffle_seed": 3}),
    "text": (lambda root: make_text_corpus(root, docs=14), {"max_count": 5}),
    "pointcloud": (lambda root: make_pointcloud_folder(root, per_class=2, points=64),
                   {"max_size": 6_000}),
    "parquet": (parquet_file, {"max_count": 4, "parquet": ParquetOptions("img", None, "y")}),
}


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_ray_writes_the_local_engines_bytes(ray_address, tmp_path, kind):
    make, options = SOURCES[kind]
    local, ray_out = by_both(tmp_path, kind, make(tmp_path / "src"), **options)
    assert_same(local, ray_out, shards=3)


def test_resharding_existing_shards_gives_the_same_bytes(ray_address, tmp_path):
    src = image_folder(tmp_path / "src")
    convert(ConvertConfig("imagefolder", str(src), str(tmp_path / "a"), max_count=5, workers=1))
    local, ray_out = by_both(tmp_path, "shards", tmp_path / "a", max_count=3, shuffle_seed=1,
                             prefix="re")
    assert_same(local, ray_out, shards=5)


def dies_once(run_task, key: str, marker: Path):
    """run_task whose first run on `key` ends its process at once (as the OOM killer would:
    no exception, no clean-up); `marker` says it happened. Nested: Ray sends it by value."""
    def run(task, work):
        if getattr(task, "key", None) == key and not marker.exists():
            marker.touch()
            os._exit(1)
        return run_task(task, work)
    return run


def test_a_task_whose_worker_died_runs_again_and_the_bytes_are_the_same(
        ray_address, tmp_path, monkeypatch):
    src = image_folder(tmp_path / "src")
    out = tmp_path / "out"
    convert(ConvertConfig("imagefolder", str(src), str(out), max_count=4, workers=1))
    local = out.rename(tmp_path / "local")
    marker = tmp_path / "died"
    monkeypatch.setattr(job, "run_task", dies_once(job.run_task, "class1_img002", marker))
    convert(ConvertConfig("imagefolder", str(src), str(out), max_count=4, engine="ray"))
    assert marker.exists(), "the worker was not killed: the test tested nothing"
    assert_same(local, out, shards=4)


def bad_image_folder(root: Path) -> Path:
    src = image_folder(root)
    (src / "class2" / "img001.jpg").write_bytes(b"<html>not found</html>")
    (src / "class1" / "img003.jpg").write_bytes(jpeg_bytes(3)[:200])  # truncated
    (src / "class2" / "empty.jpg").write_bytes(b"")
    return src


def test_skipped_inputs_are_the_same_and_counted_the_same(ray_address, tmp_path):
    local, ray_out = by_both(tmp_path, "imagefolder", bad_image_folder(tmp_path / "src"),
                             max_count=4, on_error="skip")
    assert_same(local, ray_out, shards=3)
    manifest = (ray_out / "manifest.json").read_text()
    assert '"total_samples": 15' in manifest and '"bad-image": 2' in manifest
    assert '"missing-field": 1' in manifest  # the empty file, as the loaders name one


def test_a_bad_input_under_raise_is_the_same_error_after_the_same_shards(ray_address, tmp_path):
    src = bad_image_folder(tmp_path / "src")
    out = tmp_path / "out"
    errors = []
    for engine in ("local", "ray"):
        with pytest.raises(DataError) as err:
            convert(ConvertConfig("imagefolder", str(src), str(out), max_count=2, workers=1,
                                  engine=engine))  # type: ignore[arg-type]
        errors.append(str(err.value))
        if engine == "local":
            local = out.rename(tmp_path / "local")
    assert errors[0] == errors[1] and "class1_img003" in errors[0]
    assert files(out) == files(local)  # the shards before the error, and the journal
    assert any(n.endswith(".tar") for n in files(local))


@pytest.mark.parametrize("finish", ["ray", "local"])
def test_a_run_stopped_half_way_is_finished_by_either_engine(ray_address, tmp_path, finish):
    """The driver is SIGKILLed after 10 samples (a child process on the same Ray cluster: its
    tasks die with it), then the same conversion again on either engine."""
    src = image_folder(tmp_path / "src")
    out = tmp_path / "out"
    convert(ConvertConfig("imagefolder", str(src), str(out), max_count=4, workers=1))
    local = out.rename(tmp_path / "local")
    convert_killed(ConvertConfig("imagefolder", str(src), str(out), max_count=4, engine="ray",
                                 ray_address=ray_address), 10, tmp_path)
    assert (out / ".make_shards.journal.json").exists() and not (out / "manifest.json").exists()
    convert(ConvertConfig("imagefolder", str(src), str(out), max_count=4, workers=2,
                          engine=finish))  # type: ignore[arg-type]
    assert_same(local, out, shards=4)


# -- the map itself ------------------------------------------------------------------------------

def failing(kind: str, on: int, marker: Path | None = None):
    """A map function that dies on every try at item `on`, hangs on it, or raises TypeError.
    Nested: Ray sends it by value."""
    def fn(item: int, extra: object) -> int:
        if item == on:
            if kind == "die":
                os._exit(1)
            if kind == "hang":
                threading.Event().wait()  # a read that never returns
            raise TypeError(f"a code error on {item}")
        return item
    return fn


def test_a_task_whose_worker_dies_on_every_try_is_a_worker_error_naming_it(ray_address):
    results = engine_ray.ordered_map(failing("die", 5), range(12), None, 2, chunk=1,
                                     describe=lambda i: f"input{i}")
    got = []
    with pytest.raises(WorkerError, match=r"died .* every one of 4 tries .*input4, input5"):
        got.extend(results)
    assert got == [0, 1, 2, 3]  # in order up to the lost task (4 items a task)


def test_a_hung_task_is_a_worker_error_within_the_timeout(ray_address):
    results = engine_ray.ordered_map(failing("hang", 1), range(8), None, 2, chunk=1,
                                     timeout_s=2, describe=lambda i: f"input{i}")
    started = time.monotonic()
    with deadline(60), pytest.raises(WorkerError, match=r"no result for 2 s .*input0, input1"):
        list(results)
    # After the 2 s it was given, not before; the task itself never returns (a bound with
    # slack for a busy machine, not a speed).
    assert 2 <= time.monotonic() - started <= 2 + 20


def test_an_exception_in_the_task_is_raised_as_itself(ray_address):
    results = engine_ray.ordered_map(failing("raise", 6), range(10), None, 2, chunk=1)
    with pytest.raises(TypeError, match="a code error on 6"):
        list(results)


# -- the command line ----------------------------------------------------------------------------

def test_command_line_on_a_cluster_by_address_and_on_a_local_ray(ray_address, tmp_path):
    src = image_folder(tmp_path / "src")
    out = tmp_path / "out"

    def make_shards(*args: object) -> dict[str, bytes]:
        proc = run_tool("make_shards", "imagefolder", src, out, "--max-count", 4, "--quiet",
                        *args, check=True)
        assert "17 samples" in proc.stdout
        found = files(out)
        shutil.rmtree(out)
        return found

    local = make_shards("--workers", 1)
    assert make_shards("--engine", "ray", "--ray-address", ray_address) == local
    assert make_shards("--engine", "ray", "--workers", 2) == local  # starts its own Ray


def test_ray_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="engine='spark'"):
        ConvertConfig("imagefolder", str(tmp_path), str(tmp_path / "o"), engine="spark")  # type: ignore[arg-type]
    proc = run_tool("make_shards", "imagefolder", tmp_path, tmp_path / "o", "--ray-address",
                    "auto")
    assert proc.returncode == 2 and "--engine ray" in proc.stderr
    proc = run_tool("make_shards", "imagefolder", tmp_path, tmp_path / "o", "--engine", "spark")
    assert proc.returncode == 2 and "--engine" in proc.stderr


def test_without_ray_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    src = image_folder(tmp_path / "src")
    with pytest.raises(ValueError, match=r"pip install 'shardflow\[ray\]'"):
        convert(ConvertConfig("imagefolder", str(src), str(tmp_path / "out"), engine="ray"))
    assert not (tmp_path / "out").exists()  # refused before the output folder was touched


def test_far_clouds_keep_their_offsets_on_ray(ray_address, tmp_path):
    src = make_pointcloud_folder(tmp_path / "src", per_class=1, points=32)
    far = np.random.default_rng(0).normal(size=(40, 3)) + 5e6  # geographic coordinates
    np.save(src / next(p.name for p in src.iterdir()) / "far.npy", far)
    local, ray_out = by_both(tmp_path, "pointcloud", src, max_count=2)
    assert_same(local, ray_out, shards=2)
    assert '"offset_clouds": 1' in (ray_out / "manifest.json").read_text()


def test_closing_the_map_early_does_not_wait_for_a_task_in_flight(ray_address):
    """Last in the module: the task left hung holds one of the two CPUs until Ray stops (the
    map cancels only tasks it found hung; see engine_ray.ordered_map)."""
    results = engine_ray.ordered_map(failing("hang", 5), range(40), None, 2, chunk=1)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    with deadline(60):
        results.close()
    ray = sys.modules["ray"]
    assert ray.get(ray.remote(lambda: os.getpid()).remote(), timeout=60)  # Ray serves on
