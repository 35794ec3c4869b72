"""Output to any fsspec URL, without a server: make_shards into `memory://` gives the bytes of a
local conversion (parts and merge too), refuses and cleans like a folder, and the
`--storage-option KEY=VALUE` flags become fsspec's nested options without ever echoing a
value. (A real S3 endpoint: test_s3.py.)"""

from __future__ import annotations

import argparse
import importlib
import json
import uuid
from pathlib import Path

import fsspec
import pytest
from conftest import make_image_folder

from shardflow.convert import ConvertConfig, convert
from shardflow.shards.manifest import merge_parts
from shardflow.storage import Store


@pytest.fixture
def cliutil(monkeypatch: pytest.MonkeyPatch):
    return importlib.import_module("shardflow.tools.util")


@pytest.fixture
def memory_url():
    """A fresh prefix of the in-process memory file system, removed afterwards."""
    bucket = f"test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{bucket}/out"
    fsspec.filesystem("memory").rm(f"/{bucket}", recursive=True)


def _files(out: str | Path) -> dict[str, bytes]:
    """Every file of an output, the manifest's own location (args.out) left out."""
    store = Store(out)
    files = {name: store.read_bytes(name) for name in store.names("*")}
    for name in [n for n in files if n.startswith("manifest")]:
        doc = json.loads(files[name])
        doc["args"].pop("out")
        files[name] = json.dumps(doc).encode()
    return files


def _config(src: Path, out: str | Path, **kw: object) -> ConvertConfig:
    return ConvertConfig(kind="imagefolder", src=str(src), out=str(out), max_count=5, workers=1,
                         **kw)  # type: ignore[arg-type]


def test_storage_option_flags_nest_parse_json_and_never_echo_a_value(cliutil, capsys):
    p = argparse.ArgumentParser()
    cliutil.add_storage_options(p)
    flags = ["client_kwargs.endpoint_url=http://127.0.0.1:9000", "anon=false", "key=AKIA1",
             'config_kwargs.retries={"max_attempts": 2}', 'token="123"', "profile=a=b"]
    args = p.parse_args([a for flag in flags for a in ("--storage-option", flag)])
    assert args.storage_options == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}, "anon": False,
        "key": "AKIA1", "config_kwargs": {"retries": {"max_attempts": 2}}, "token": "123",
        "profile": "a=b"}
    assert p.parse_args([]).storage_options == {} and p.parse_args([]).storage_options == {}
    for bad, said in ((["TOPSECRETVALUE"], "KEY=VALUE"), ([".x=TOPSECRETVALUE"], "KEY=VALUE"),
                      (["a=1", "a.b=TOPSECRETVALUE"], "a already has a value"),
                      (["a.b=1", "a=TOPSECRETVALUE"], "a is given twice")):
        with pytest.raises(SystemExit):
            p.parse_args([x for flag in bad for x in ("--storage-option", flag)])
        err = capsys.readouterr().err
        assert said in err and "TOPSECRETVALUE" not in err, err


def test_convert_into_a_url_gives_the_local_bytes_parts_and_merge_too(tmp_path, memory_url):
    src = make_image_folder(tmp_path / "src", per_class=4)
    local = convert(_config(src, tmp_path / "local"))
    remote = convert(_config(src, memory_url, storage_options={"unused": "ok"}))
    assert remote.to_json()["args"]["out"] == memory_url
    assert _files(memory_url) == _files(tmp_path / "local") and len(local.shards) == 3
    for i in range(2):
        convert(_config(src, tmp_path / "parts", part=(i, 2)))
        convert(_config(src, f"{memory_url}-parts", part=(i, 2)))
    merge_parts(tmp_path / "parts")
    merged = merge_parts(f"{memory_url}-parts/")
    assert merged.total_samples == 12
    assert _files(f"{memory_url}-parts") == _files(tmp_path / "parts")
    assert not [n for n in Store(memory_url).names(".*") if n != "."]  # no temp, no journal


def test_a_url_output_is_refused_cleaned_and_guarded_like_a_folder(tmp_path, memory_url):
    src = make_image_folder(tmp_path / "src", per_class=2)
    convert(_config(src, memory_url))
    with pytest.raises(FileExistsError, match="already holds a finished conversion"):
        convert(_config(src, memory_url))
    store = Store(memory_url)
    store.write_bytes("other-000000.tar", b"not ours")
    store.write_bytes(".train-000009.tar.tmp", b"a killed upload's leftover")
    store.delete("manifest.json")
    with pytest.raises(FileExistsError, match=r"already holds shards \(other-000000.tar"):
        convert(_config(src, memory_url))
    convert(_config(src, memory_url, overwrite=True))
    assert store.names("*.tar") == ["train-000000.tar", "train-000001.tar"]
    assert not store.names(".*.tmp")
    reshard = ConvertConfig(kind="shards", src=f"{memory_url}/*.tar", out=memory_url,
                            workers=1, overwrite=True)
    with pytest.raises(ValueError, match="holds the source shards"):
        convert(reshard)


def test_a_store_names_itself_without_credentials():
    store = Store("https://user:pa55word@example.org/data?X-Amz-Signature=s1gn", {"k": "v"})
    for text in (str(store), repr(store), store.where("train-000000.tar")):
        assert "pa55word" not in text and "s1gn" not in text and "'v'" not in text
    assert str(Store("file:///tmp/x/")) == "/tmp/x"
    with pytest.raises(TypeError, match="dict of fsspec options"):
        Store("memory://x", ["key", "secret"])  # type: ignore[arg-type]
