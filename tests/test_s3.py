"""Shards on a real S3 endpoint: moto's S3 server on 127.0.0.1 (a free port), s3fs as fsspec's
S3, the endpoint and credentials given as storage options. make_shards writes into the bucket
the bytes it writes to a folder, verify_shards checks them, every loader reads them as it reads
local shards, train.py trains on them, a CSV manifest of s3:// images converts; an upload
cut off part way leaves no object under a final name and the same conversion run again
finishes it; the secret shows nowhere."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import make_image_folder, run_tool

from shardflow import image_loader, pointcloud_loader, text_loader
from shardflow.builtin import make_pointcloud_folder, make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.errors import DataError
from shardflow.storage import Store

KEY = "AKIAFAKEKEYFORTESTS1"
SECRET = "fake-S3CRET-never-shown-0451"
REGION = "us-east-1"

# One worker runs the module (pytest-xdist's loadgroup): one moto server and its shards serve
# every test.
pytestmark = pytest.mark.xdist_group("s3")


@dataclass(frozen=True)
class S3:
    """The server's endpoint and one bucket on it."""

    endpoint: str
    bucket: str = "shards"

    @property
    def options(self) -> dict[str, object]:
        return {"key": KEY, "secret": SECRET,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION}}

    @property
    def flags(self) -> list[str]:
        options = [f"key={KEY}", f"secret={SECRET}", f"client_kwargs.endpoint_url={self.endpoint}",
                   f"client_kwargs.region_name={REGION}"]
        return [arg for option in options for arg in ("--storage-option", option)]

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def files(self, prefix: str) -> dict[str, bytes]:
        """Every object under the prefix (hidden ones too), by name."""
        store = Store(self.url(prefix), self.options)
        return {name: store.read_bytes(name) for name in store.names("*")}


def _name_request_threads(server: object) -> None:
    """The server's request threads named as this suite's servers' are ("test-..."), so that
    the thread check (conftest.py) tells them from a thread a loader leaves behind: they live
    as long as a pooled connection to the server does."""
    def process_request(request: object, client_address: object) -> None:
        threading.Thread(target=server.process_request_thread,  # type: ignore[attr-defined]
                         args=(request, client_address), daemon=True,
                         name="test-moto-request").start()

    server.process_request = process_request  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    import boto3
    from moto.server import ThreadedMotoServer

    quiet = logging.getLogger("werkzeug")
    level, quiet.level = quiet.level, logging.ERROR  # one line per request otherwise
    # Never ask the cloud's metadata address for credentials (the tools run as subprocesses).
    metadata = os.environ.get("AWS_EC2_METADATA_DISABLED")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        _name_request_threads(server._server)
        host, port = server.get_host_and_port()
        found = S3(f"http://{host}:{port}")
        boto3.client("s3", endpoint_url=found.endpoint, aws_access_key_id=KEY,
                     aws_secret_access_key=SECRET, region_name=REGION
                     ).create_bucket(Bucket=found.bucket)
        yield found
    finally:
        server.stop()
        quiet.level = level
        if metadata is None:
            os.environ.pop("AWS_EC2_METADATA_DISABLED", None)
        else:
            os.environ["AWS_EC2_METADATA_DISABLED"] = metadata


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    root = tmp_path_factory.mktemp("s3src")
    return {"image": ("imagefolder", make_image_folder(root / "images", per_class=4)),
            "text": ("text", make_text_corpus(root / "text", docs=14)),
            "pointcloud": ("pointcloud", make_pointcloud_folder(root / "pc", per_class=3,
                                                                points=64))}


def _convert(kind: str, src: Path, out: str | Path, options: object = None, **kw: object
             ) -> None:
    kw = {"max_count": 5, **kw}
    convert(ConvertConfig(kind=kind, src=str(src), out=str(out), workers=1,
                          storage_options=options or {}, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def converted(s3: S3, sources: dict[str, tuple[str, Path]],
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    """Each modality converted into the bucket and into a folder: (its URL, the folder)."""
    root = tmp_path_factory.mktemp("s3local")
    done = {}
    for modality, (kind, src) in sources.items():
        _convert(kind, src, s3.url(modality), s3.options)
        _convert(kind, src, root / modality)
        done[modality] = (s3.url(modality), root / modality)
    return done


def _without_location(files: dict[str, bytes]) -> dict[str, bytes]:
    doc = json.loads(files["manifest.json"])
    doc["args"].pop("out")
    return {**files, "manifest.json": json.dumps(doc).encode()}


def _local_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_make_shards_writes_the_folder_bytes_into_s3_and_verify_shards_reads_them(
        s3, sources, tmp_path):
    kind, src = sources["image"]
    made = run_tool("make_shards", kind, src, s3.url("tool"), "--max-count", 5, "--workers", 1,
                    *s3.flags)
    run_tool("make_shards", kind, src, tmp_path / "local", "--max-count", 5, "--workers", 1,
             check=True)
    assert made.returncode == 0, made.stderr[-2000:]
    assert "s3://shards/tool: 3 shards, 12 samples" in made.stdout
    in_bucket = s3.files("tool")
    assert sorted(in_bucket) == sorted(_local_files(tmp_path / "local"))  # no temp, no journal
    assert _without_location(in_bucket) == _without_location(_local_files(tmp_path / "local"))
    checked = run_tool("verify_shards", s3.url("tool"), "--world-size", 2, "--quiet", *s3.flags)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    assert "all shards verified: no problems" in checked.stdout
    assert "3 shards, 12 samples (manifest: 12)" in checked.stdout
    for proc in (made, checked):
        assert SECRET not in proc.stdout + proc.stderr and KEY not in proc.stdout + proc.stderr
    assert not any(SECRET.encode() in data or KEY.encode() in data for data in in_bucket.values())


LOADERS = {
    "image": lambda source, **kw: image_loader(source, batch_size=4, size=16, **kw),
    "text": lambda source, **kw: text_loader(source, batch_size=4, seq_len=32, **kw),
    "pointcloud": lambda source, **kw: pointcloud_loader(source, batch_size=4, num_points=32,
                                                         **kw),
}


def _read(modality: str, source: object, **kw: object) -> tuple[list, str]:
    """Every batch's keys and first tensor, and the loader's state as JSON."""
    with LOADERS[modality](source, device="cpu", train=False, reader="stream", **kw) as loader:
        batches = [(list(b.keys), next(v for v in vars(b).values() if hasattr(v, "shape")))
                   for b in loader]
        return batches, json.dumps(loader.state_dict()) + repr(loader.cfg)


@pytest.mark.parametrize("modality", sorted(LOADERS))
def test_every_loader_reads_s3_shards_as_it_reads_the_folder(s3, converted, modality, caplog):
    url, folder = converted[modality]
    for logger in ("shardflow", "fsspec", "s3fs"):
        caplog.set_level(logging.DEBUG, logger=logger)
    remote, state = _read(modality, url, storage_options=s3.options)
    local, _ = _read(modality, folder)
    assert [keys for keys, _ in remote] == [keys for keys, _ in local] and remote
    assert all(a.equal(b) for (_, a), (_, b) in zip(remote, local, strict=True))
    with pytest.raises(FileNotFoundError) as missing:  # a prefix with no shards
        _read(modality, s3.url("nothing-here/"), storage_options=s3.options)
    logs = "\n".join(r.getMessage() for r in caplog.records)
    for where, text in {"state and config": state, "error": str(missing.value),
                        "logs": logs}.items():
        assert SECRET not in text, f"the secret reached the {where}"


def test_train_py_trains_on_s3_shards(s3, converted, tmp_path):
    url, _ = converted["image"]
    out = tmp_path / "run"
    proc = run_tool("train", "--task", "image", "--data", url, "--out", out, "--steps", 2,
                    "--batch-size", 4, "--size", 16, "--device", "cpu", "--precision", "fp32",
                    "--log-every", 1, "--quiet", *s3.flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "train-000002.tar" in summary["held_out"]
    assert SECRET not in proc.stdout + proc.stderr
    for path in (p for p in out.rglob("*") if p.is_file()):
        assert SECRET.encode() not in path.read_bytes(), f"the secret is in {path.name}"


def test_an_upload_cut_off_leaves_no_partial_object_and_a_rerun_finishes(
        s3, sources, monkeypatch):
    """The third shard's upload breaks in the file system (s3fs), below the code under test:
    Store.publish runs as it does, its temporary key gets half the bytes, the connection
    drops. No partial object under a final name, the journal says two shards, and the same
    command again finishes with the bytes of an uninterrupted run."""
    import s3fs

    kind, src = sources["image"]
    real_put, cut = s3fs.S3FileSystem._put_file, []

    async def put_cut_off(self, lpath, rpath, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(lpath).name.startswith("train-000002."):  # its first file, whichever
            cut.append(rpath)
            await self._pipe_file(rpath, Path(lpath).read_bytes()[:1000])
            raise ConnectionResetError("the connection dropped (simulated in s3fs)")
        return await real_put(self, lpath, rpath, *args, **kwargs)

    # s3fs binds its sync methods per instance, and fsspec caches instances: a fresh one
    # picks up the patched coroutine (and, afterwards, the real one again)
    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", put_cut_off)
    with pytest.raises(ConnectionResetError, match="connection dropped"):
        _convert(kind, src, s3.url("cut"), s3.options, max_count=2)
    monkeypatch.undo()
    s3fs.S3FileSystem.clear_instance_cache()
    assert len(cut) == 1 and re.search(r"/\.train-000002\.(tar|idx)\.tmp$", cut[0]), cut
    left = s3.files("cut")
    finished = {f"train-00000{i}.{ext}" for i in range(2) for ext in ("tar", "idx")}
    assert not {n for n in left if n.startswith("train-000002")}, sorted(left)
    assert set(left) - {Path(cut[0]).name} == finished | {".make_shards.journal.json"}
    assert len(json.loads(left[".make_shards.journal.json"])["shards"]) == 2
    _convert(kind, src, s3.url("cut"), s3.options, max_count=2)  # the same command again
    _convert(kind, src, s3.url("whole"), s3.options, max_count=2)
    resumed, whole = s3.files("cut"), s3.files("whole")
    assert _without_location(resumed) == _without_location(whole) and len(resumed) == 13


def test_no_secret_in_errors_of_a_missing_bucket_or_a_bad_flag(s3, sources, tmp_path):
    kind, src = sources["text"]
    runs = [run_tool("make_shards", kind, src, "s3://no-such-bucket/x", "--quiet", *s3.flags),
            run_tool("train", "--task", "text", "--data", s3.url("nothing-here"), "--out",
                     tmp_path / "run", "--steps", 1, *s3.flags),
            run_tool("make_shards", kind, src, s3.url("x"), "--storage-option", SECRET)]
    assert [r.returncode for r in runs] == [2, 2, 2], [r.stderr[-500:] for r in runs]
    assert "s3://no-such-bucket/x: The specified bucket does not exist" in runs[0].stderr
    assert "s3://shards/nothing-here" in runs[1].stderr and "KEY=VALUE" in runs[2].stderr
    for proc in runs:
        assert SECRET not in proc.stdout + proc.stderr
    with pytest.raises(DataError) as bad:  # a shard that is not a tar, read from the bucket
        Store(s3.url("junk"), s3.options).write_bytes("train-000000.tar", b"<html>no</html>")
        _read("text", s3.url("junk/train-000000.tar"), storage_options=s3.options)
    assert "s3://shards/junk/train-000000.tar" in str(bad.value) and SECRET not in str(bad.value)


def test_a_manifest_listing_s3_urls_reads_them_with_the_storage_options(s3, tmp_path):
    images = make_image_folder(tmp_path / "images", classes=2, per_class=2)
    store, rows = Store(s3.url("raw"), s3.options), ["path,label"]
    for path in sorted(images.rglob("*.jpg")):
        store.write_bytes(f"{path.parent.name}-{path.name}", path.read_bytes())
        rows.append(f"{s3.url('raw')}/{path.parent.name}-{path.name},{path.parent.name}")
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    convert(ConvertConfig(kind="manifest", src=str(tmp_path / "list.csv"), out=str(out),
                          workers=2, storage_options=s3.options))  # read in worker processes
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["total_samples"] == 4 and manifest["classes"] == {"class0": 0, "class1": 1}
    assert SECRET.encode() not in b"".join(p.read_bytes() for p in out.iterdir())


@pytest.mark.parametrize("modality", ["image", "text", "pointcloud"])
def test_shard_dataset_reads_s3_samples_by_range_requests_as_the_folder(s3, converted,
                                                                        modality):
    import numpy as np

    from shardflow import ShardDataset

    url, folder = converted[modality]
    remote, local = ShardDataset(url, storage_options=s3.options), ShardDataset(folder)
    assert remote.keys() == local.keys() and len(remote) == len(local) > 0
    for i in range(len(local)):
        a, b = remote[i], local[i]
        assert a.keys() == b.keys() and a["__key__"] == b["__key__"]
        for name in a:
            if not name.startswith("__"):
                same = np.array_equal(a[name], b[name]) if isinstance(a[name], np.ndarray) \
                    else a[name] == b[name]
                assert same, (i, name)
