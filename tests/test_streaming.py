"""The streaming reader at scale: several shards in flight with their samples interleaved, a
resume that fetches only what the replay needs, a bounded local cache of remote shards shared
by processes, and one listing instead of one request per shard at start-up. Remote here is a
server on 127.0.0.1 the tests start (HTTP with range requests; memory:// for listings)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import ROOT, RangeHandler, http_server, run_tool

from shardflow import image_loader
from shardflow.builtin import make_image_folder
from shardflow.loading.shardcache import ShardCache
from shardflow.loading.shardlist import ShardSpec, resolve_source

OPTS = {"device": "cpu", "size": 16, "use_tuning": False, "threads": 1, "prefetch": 2}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 images, 10 shards of 8, one class per shard (converted in class order)."""
    root = tmp_path_factory.mktemp("streaming")
    src = make_image_folder(root / "src", per_class=8, size=16)
    run_tool("make_shards", "imagefolder", src, root / "out", "--max-count", 8, check=True)
    return root / "out"


@pytest.fixture(scope="module")
def url(shards: Path):
    with http_server(shards, RangeHandler) as base:
        yield base


def _shard_bytes(shards: Path) -> int:
    return sum(p.stat().st_size for p in shards.glob("*.tar"))


def _keys(batches: list) -> list[str]:
    return [k for b in batches for k in b.keys]


def _loader(source: str, **kw):
    return image_loader(source, batch_size=8, reader="stream", **{**OPTS, **kw})


def test_shards_in_flight_interleave_their_samples(url):
    firsts = {}
    for in_flight in (1, 4):
        with _loader(url, shuffle_buffer=2, shards_in_flight=in_flight) as loader:
            batches = list(loader)
        keys = _keys(batches)
        assert len(keys) == len(set(keys)) == 80
        firsts[in_flight] = {k[:2] for k in keys[:16]}  # a shard is a class: "00_circle..."
    assert len(firsts[1]) <= 3 and len(firsts[4]) >= 4


def test_evaluation_reads_shards_in_order_whatever_is_in_flight(url, shards):
    orders = []
    for in_flight in (1, 3):
        with _loader(url, train=False, shards_in_flight=in_flight) as loader:
            orders.append(_keys(list(loader)))
    assert orders[0] == orders[1] == sorted(orders[0], key=lambda k: k[:2])


def test_a_resume_fetches_only_what_the_replay_needs(url, shards):
    kw = {"shuffle_buffer": 8, "shards_in_flight": 2, "seed": 5}
    rest, everything, state, fetched = _resumed(url, kw)
    # 56 of 80 samples were emitted: the replay fetches the shards still open and those not
    # reached yet; the ones before are replayed from their counts, but for their samples still
    # in the shuffle buffer, fetched again one by one (range requests through the .idx).
    saved = state["ranks"][0]["reader_state"]
    needed, stragglers = saved["needed"], saved["stragglers"]
    size = max(p.stat().st_size for p in shards.glob("*.tar"))
    assert needed >= 5 and stragglers
    assert fetched < (10 - needed) * size + len(stragglers) * 4096 < _shard_bytes(shards)


def _resumed(source: str, kw: dict) -> tuple[list, list, dict, int]:
    """(the batches after the 7th of a resumed epoch, the whole epoch, the state, remote bytes
    the resumed loader fetched); checks that the resume gives exactly what came next."""
    with _loader(source, **kw) as whole:
        everything = list(whole)
    with _loader(source, **kw) as first:
        it = iter(first)
        for _ in range(7):
            next(it)
        it.close()
        state = first.state_dict()
    with _loader(source, **kw) as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
        fetched = resumed.fetch_stats.remote_bytes
    assert _keys(rest) == _keys(everything[7:])  # exactly what came next
    for a, b in zip(rest, everything[7:], strict=True):
        assert torch.equal(a.image, b.image)
    return rest, everything, state, fetched


def test_a_resume_without_index_files_reads_those_shards_through(shards, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for p in shards.iterdir():
        if p.suffix != ".idx":
            (bare / p.name).write_bytes(p.read_bytes())
    with http_server(bare, RangeHandler) as base:
        _, _, state, _ = _resumed(base, {"shuffle_buffer": 8, "shards_in_flight": 2,
                                         "seed": 5})
    assert state["ranks"][0]["reader_state"]["stragglers"]


def test_the_cache_serves_the_next_epoch_and_stays_under_its_limit(url, shards, tmp_path):
    total = _shard_bytes(shards)
    with _loader(url, cache_dir=str(tmp_path / "c"), cache_limit=10 * total) as loader:
        first = _keys(list(loader))
        after_one = loader.fetch_stats.remote_bytes
        second = _keys(list(loader))
        stats = loader.fetch_stats
    assert sorted(first) == sorted(second)
    assert after_one >= total * 0.99 and stats.remote_bytes == after_one  # nothing again
    assert stats.cache_hits == 10
    cached = sorted(tmp_path.joinpath("c").iterdir())
    by_name = {p.name: p.read_bytes() for p in shards.glob("*.tar")}
    assert len(cached) == 10 and all(p.read_bytes() in by_name.values() for p in cached)
    small = 3 * max(len(b) for b in by_name.values()) + 1
    with _loader(url, cache_dir=str(tmp_path / "small"), cache_limit=small) as loader:
        list(loader)
    kept = list(tmp_path.joinpath("small").iterdir())
    assert 1 <= len(kept) <= 3 and sum(p.stat().st_size for p in kept) <= small


_READ_ONE_EPOCH = """
import sys
from shardflow import image_loader
with image_loader(sys.argv[1], batch_size=8, reader="stream", device="cpu", size=16,
                  use_tuning=False, threads=1, cache_dir=sys.argv[2],
                  cache_limit=1 << 30, seed=int(sys.argv[3])) as loader:
    print(sum(len(b) for b in loader))
"""


def test_processes_share_a_cache_safely(url, shards, tmp_path):
    cache = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", _READ_ONE_EPOCH, url, str(cache),
                               str(seed)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == "80"
    originals = {hashlib.sha256(p.read_bytes()).hexdigest() for p in shards.glob("*.tar")}
    entries = list(cache.iterdir())
    assert not [p for p in entries if p.name.startswith(".")], "a temporary file stayed"
    assert {hashlib.sha256(p.read_bytes()).hexdigest() for p in entries} == originals


def test_a_copy_not_matching_the_manifest_is_not_cached(shards, tmp_path, caplog):
    data = (shards / "train-000000.tar").read_bytes()
    spec = ShardSpec("http://127.0.0.1:9/train-000000.tar", 8, sha256="0" * 64)
    cache = ShardCache(tmp_path, limit=1 << 20)
    writer = cache.writer(spec)
    writer.write(data)
    assert writer.commit() is False and cache.lookup(spec) is None
    assert "sha256" in caplog.text and not list(tmp_path.iterdir())
    good = ShardSpec(spec.url, 8, sha256=hashlib.sha256(data).hexdigest())
    writer = cache.writer(good)
    writer.write(data)
    assert writer.commit() and cache.lookup(good).read_bytes() == data
    # an entry is named by URL and checksum: a rewritten dataset is not served stale bytes
    assert cache.path_for(good) != cache.path_for(spec)


def test_temporary_files_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    orphan = tmp_path / f".abc-train.tar.{dead}.1234abcd.part"
    mine = tmp_path / f".abc-train.tar.{os.getpid()}.1234abcd.part"
    orphan.write_bytes(b"x")
    mine.write_bytes(b"x")
    ShardCache(tmp_path, limit=1 << 20)
    assert not orphan.exists() and mine.exists()


def test_start_up_lists_each_folder_once_instead_of_asking_per_shard(shards, monkeypatch):
    fs = fsspec.filesystem("memory")
    for p in sorted(shards.iterdir()):
        fs.pipe(f"/stream-listing/{p.name}", p.read_bytes())
    calls = {"ls": 0}
    real_ls = type(fs).ls

    def counted_ls(self, path, detail=True, **kw):  # type: ignore[no-untyped-def]
        calls["ls"] += 1
        return real_ls(self, path, detail=detail, **kw)

    def no_exists(self, path, **kw):  # type: ignore[no-untyped-def]
        raise AssertionError(f"one request per shard: exists({path})")

    monkeypatch.setattr(type(fs), "ls", counted_ls)
    monkeypatch.setattr(type(fs), "exists", no_exists)
    urls = [f"memory://stream-listing/{p.name}" for p in sorted(shards.glob("*.tar"))]
    source = resolve_source(urls)
    assert len(source.shards) == 10 and calls["ls"] == 1
    with pytest.raises(FileNotFoundError, match="1 of 11 shards are missing"):
        resolve_source([*urls, "memory://stream-listing/nope.tar"])
    assert json.loads(fs.cat("/stream-listing/manifest.json"))["shards"]


def test_train_py_streams_through_a_cache(url, tmp_path):
    cache = tmp_path / "cache"
    done = run_tool("train", "--task", "image", "--data", url, "--out", tmp_path / "run",
                    "--steps", 2, "--batch-size", 8, "--size", 16, "--device", "cpu",
                    "--precision", "fp32", "--shards-in-flight", 3, "--cache-dir", cache,
                    "--cache-limit", "64MB", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p for p in cache.iterdir() if p.suffix == ".tar"], "nothing was cached"
