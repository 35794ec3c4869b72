"""Secrets in shard URLs reach no output, for every loader and tool at once: shards served on
127.0.0.1 with a signed-URL query string, one of them broken, read by the image, text and
point-cloud loaders (errors, skip entries, loader state, every log record at DEBUG) and by
make_shards, verify_shards and train_tokenizer (stdout, stderr, every file they write); and a
secret among the storage options (`storage_options=`, `--storage-option`) in none of those
either (test_s3.py: the same against a real S3 endpoint, train.py's run folder too)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from conftest import RangeHandler, http_server, make_image_folder, run_tool

from shardflow import image_loader, pointcloud_loader, text_loader
from shardflow.builtin import make_pointcloud_folder, make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.errors import DataError
from shardflow.loading import fetch

SECRET = "SECRETSIG"
QUERY = f"?X-Amz-Signature={SECRET}&X-Amz-Credential=AKIA{SECRET}"


class _CutHandler(RangeHandler):
    """Serves files, except `broken.tar`, whose every download stops part way through."""

    def do_GET(self) -> None:
        if "broken.tar" not in self.path:
            return super().do_GET()
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        self.wfile.write(b"\0" * 1000)
        self.close_connection = True
        return None


def _shards(root: Path, modality: str) -> Path:
    if modality == "image":
        src, kind = make_image_folder(root / "src", per_class=4), "imagefolder"
    elif modality == "text":
        src, kind = make_text_corpus(root / "src", docs=24), "text"
    else:
        src, kind = make_pointcloud_folder(root / "src", per_class=3, points=64), "pointcloud"
    out = root / "shards"
    convert(ConvertConfig(kind=kind, src=str(src), out=out, max_count=6, workers=1))
    shutil.copy(next(out.glob("*.tar")), out / "broken.tar")
    return out


LOADERS = {
    "image": lambda urls, **kw: image_loader(urls, batch_size=4, device="cpu", size=16, **kw),
    "text": lambda urls, **kw: text_loader(urls, batch_size=4, seq_len=32, device="cpu", **kw),
    "pointcloud": lambda urls, **kw: pointcloud_loader(urls, batch_size=4, num_points=32,
                                                       device="cpu", **kw),
}


@pytest.mark.parametrize("modality", sorted(LOADERS))
def test_loaders_never_show_url_secrets(tmp_path, modality, monkeypatch, caplog):
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.01)
    shards = _shards(tmp_path, modality)
    names = sorted(p.name for p in shards.glob("*.tar"))
    make = LOADERS[modality]
    with http_server(shards, _CutHandler) as base, caplog.at_level(logging.DEBUG):
        urls = [f"{base}/{name}{QUERY}" for name in names]
        with make(urls, on_error="skip") as loader:
            seen = sum(len(b) for b in loader)
            state = json.dumps(loader.state_dict())
            skipped = json.dumps(loader.skipped)
        with make(urls, on_error="raise") as loader, pytest.raises(DataError) as info:
            for _ in loader:
                pass
    assert seen > 0 and "fetch-failed" in skipped and "broken.tar" in skipped
    assert "broken.tar" in str(info.value)
    logs = "\n".join(r.getMessage() for r in caplog.records)
    for where, text in {"state": state, "skips": skipped, "error": str(info.value),
                        "logs": logs}.items():
        assert SECRET not in text, f"the secret reached the {where}"


def test_tools_never_show_url_secrets(tmp_path):
    shards = _shards(tmp_path, "text")
    (shards / "broken.tar").unlink()
    out = tmp_path / "out"
    with http_server(shards, RangeHandler) as base:
        pattern = f"{base}/train-{{000000..000003}}.tar{QUERY}"
        runs = [run_tool("make_shards", "shards", pattern, out, "--on-error", "skip"),
                run_tool("verify_shards", pattern),
                run_tool("train_tokenizer", pattern, "--out", tmp_path / "tok" / "t.json",
                         "--vocab-size", 300)]
        missing = run_tool("make_shards", "shards", f"{base}/nope.tar{QUERY}", tmp_path / "o2")
    assert all(r.returncode == 0 for r in runs), [(r.returncode, r.stderr[-300:]) for r in runs]
    assert missing.returncode != 0 and "nope.tar" in missing.stderr
    for proc in (*runs, missing):
        assert SECRET not in proc.stdout + proc.stderr
    written = [p for p in (out, tmp_path / "tok", tmp_path / "o2") if p.exists()]
    for path in (f for folder in written for f in folder.rglob("*") if f.is_file()):
        assert SECRET.encode() not in path.read_bytes(), f"the secret is in {path.name}"
    assert json.loads((out / "manifest.json").read_text())["total_samples"] == 24


OPTIONS = {"key": f"AKIA{SECRET}", "secret": SECRET, "client_kwargs": {"region_name": "x"}}


@pytest.mark.parametrize("modality", sorted(LOADERS))
def test_storage_options_reach_no_loader_output(tmp_path, modality, caplog):
    """Storage options hold credentials: not in a loader's state, config, logs or errors (the
    local file system takes and ignores them; test_s3.py reads a real S3 endpoint)."""
    shards = _shards(tmp_path, modality)
    make = LOADERS[modality]
    with caplog.at_level(logging.DEBUG):
        with make(str(shards), storage_options=OPTIONS) as loader:
            assert sum(len(b) for b in loader) > 0
            state = json.dumps(loader.state_dict()) + repr(loader.cfg) + repr(loader.source)
        with pytest.raises(FileNotFoundError) as missing:
            make([str(shards / "nope.tar")], storage_options=OPTIONS)
    logs = "\n".join(r.getMessage() for r in caplog.records)
    for where, text in {"state": state, "error": str(missing.value), "logs": logs}.items():
        assert SECRET not in text, f"the secret reached the {where}"


def test_storage_option_flags_reach_no_tool_output(tmp_path):
    docs = make_text_corpus(tmp_path / "docs", docs=12)
    out, flags = tmp_path / "out", ["--storage-option", f"secret={SECRET}"]
    runs = [run_tool("make_shards", "text", docs, out, "--max-count", 5, *flags),
            run_tool("make_shards", "text", docs, out, *flags),  # refused: already there
            run_tool("verify_shards", out, *flags),
            run_tool("train_tokenizer", out, "--out", tmp_path / "tok" / "t.json",
                     "--vocab-size", 300, *flags)]
    assert [r.returncode for r in runs] == [0, 2, 0, 0], [r.stderr[-300:] for r in runs]
    for proc in runs:
        assert SECRET not in proc.stdout + proc.stderr
    for path in (f for folder in (out, tmp_path / "tok") for f in folder.rglob("*")):
        assert SECRET.encode() not in path.read_bytes(), f"the secret is in {path.name}"
