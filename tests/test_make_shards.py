"""make_shards round trips for every source kind, read back with webdataset and with DALI."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from conftest import (
    jpeg_bytes,
    load_manifest,
    make_image_folder,
    read_dali,
    read_wds,
    run_tool,
    shard_paths,
)

from shardflow.builtin import make_pointcloud_folder, make_text_corpus


def test_imagefolder_round_trip_bytes_labels_and_dali(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=3, per_class=5)
    (src / "class1" / "extra.png").write_bytes(jpeg_bytes(7, fmt="PNG"))
    out = tmp_path / "out"
    run_tool("make_shards", "imagefolder", src, out, "--max-count", 4, "--workers", 2,
             check=True)
    m = load_manifest(out)
    assert m["classes"] == {"class0": 0, "class1": 1, "class2": 2}
    assert m["total_samples"] == 16 and m["modality"] == "image"
    assert [s["samples"] for s in m["shards"]] == [4, 4, 4, 4]
    assert all((out / s["name"].replace(".tar", ".idx")).exists() for s in m["shards"])
    originals = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*.*")}
    by_key = {s["__key__"]: s for s in read_wds(out)}
    assert by_key["class1_extra"]["png"] == originals["class1/extra.png"]
    for rel, data in originals.items():
        sample = by_key[rel.rsplit(".", 1)[0].replace("/", "_")]
        assert sample.get("jpg", sample.get("png")) == data  # original bytes, no re-encoding
        assert int(sample["cls"]) == int(rel[5])
    dali = read_dali(out, ["jpg;png", "cls"])
    wds_order = read_wds(out)
    assert [d[0] for d in dali] == [s.get("jpg", s.get("png")) for s in wds_order]
    assert [int(d[1]) for d in dali] == [int(s["cls"]) for s in wds_order]


def test_dali_really_uses_the_index_files(tmp_path):
    """Swap two entries in an index: DALI then returns the samples swapped, so it read the
    index rather than scanning the tar."""
    src = make_image_folder(tmp_path / "src", classes=1, per_class=3)
    out = tmp_path / "out"
    run_tool("make_shards", "imagefolder", src, out, check=True)
    before = read_dali(out, ["jpg", "cls"])
    idx = out / "train-000000.idx"
    lines = idx.read_text().splitlines()
    lines[1], lines[2] = lines[2], lines[1]
    idx.write_text("\n".join(lines) + "\n")
    after = read_dali(out, ["jpg", "cls"])
    assert [a[0] for a in after] == [before[1][0], before[0][0], before[2][0]]


def test_manifest_csv_and_jsonl_with_names_ints_and_no_labels(tmp_path):
    img = tmp_path / "imgs"
    img.mkdir()
    for i in range(4):
        (img / f"p{i}.jpg").write_bytes(jpeg_bytes(i))
    (tmp_path / "named.csv").write_text(
        "path,label\n" + "".join(f"imgs/p{i}.jpg,{'dog' if i % 2 else 'cat'}\n" for i in range(4)))
    (tmp_path / "ints.jsonl").write_text(
        "".join(json.dumps({"file": f"imgs/p{i}.jpg", "y": i + 5}) + "\n" for i in range(4)))
    (tmp_path / "plain.csv").write_text("path\n" + "".join(f"imgs/p{i}.jpg\n" for i in range(4)))
    run_tool("make_shards", "manifest", tmp_path / "named.csv", tmp_path / "o1", check=True)
    run_tool("make_shards", "manifest", tmp_path / "ints.jsonl", tmp_path / "o2",
             "--path-column", "file", "--label-column", "y", check=True)
    run_tool("make_shards", "manifest", tmp_path / "plain.csv", tmp_path / "o3", check=True)
    assert load_manifest(tmp_path / "o1")["classes"] == {"cat": 0, "dog": 1}
    assert [int(s["cls"]) for s in read_wds(tmp_path / "o1")] == [0, 1, 0, 1]
    assert [int(s["cls"]) for s in read_wds(tmp_path / "o2")] == [5, 6, 7, 8]
    plain = read_wds(tmp_path / "o3")
    assert [sorted(k for k in s if not k.startswith("__")) for s in plain] == [["jpg"]] * 4
    assert plain[2]["jpg"] == (img / "p2.jpg").read_bytes()


def test_text_documents_lines_and_jsonl(tmp_path):
    corpus = make_text_corpus(tmp_path / "corpus", docs=6)
    run_tool("make_shards", "text", corpus, tmp_path / "docs", check=True)
    docs = read_wds(tmp_path / "docs")
    assert [s["txt"] for s in docs] == [p.read_bytes() for p in sorted(corpus.glob("*.txt"))]
    lines = tmp_path / "lines.txt"
    lines.write_text("first doc\n\nsecond, naïve café\nthird\n", encoding="utf-8")
    run_tool("make_shards", "text", lines, tmp_path / "lines", "--split-lines", check=True)
    assert [s["txt"].decode() for s in read_wds(tmp_path / "lines")] == [
        "first doc", "second, naïve café", "third"]
    jl = tmp_path / "j.jsonl"
    jl.write_text('{"body": "alpha"}\n{"body": "beta"}\n')
    run_tool("make_shards", "text", jl, tmp_path / "jl", "--text-field", "body", check=True)
    assert [s["txt"] for s in read_wds(tmp_path / "jl")] == [b"alpha", b"beta"]
    assert [d[0] for d in read_dali(tmp_path / "jl", ["txt"])] == [b"alpha", b"beta"]


def _ply_ascii(points: np.ndarray) -> bytes:
    head = (f"ply\nformat ascii 1.0\nelement vertex {len(points)}\nproperty float x\n"
            "property float y\nproperty float z\nend_header\n")
    return (head + "".join(" ".join(f"{v:.6f}" for v in p) + "\n" for p in points)).encode()


def _off(points: np.ndarray) -> bytes:
    body = "".join(" ".join(f"{v:.6f}" for v in p) + "\n" for p in points)
    return f"OFF\n{len(points)} 0 0\n{body}".encode()


def test_pointcloud_formats_become_float32_npy(tmp_path):
    src = make_pointcloud_folder(tmp_path / "src", per_class=2, points=64)
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(50, 3)).astype(np.float32)
    (src / "sphere" / "extra_ply.ply").write_bytes(_ply_ascii(pts))
    (src / "cube" / "extra_off.off").write_bytes(_off(pts))
    out = tmp_path / "out"
    run_tool("make_shards", "pointcloud", src, out, check=True)
    m = load_manifest(out)
    assert m["modality"] == "pointcloud" and len(m["classes"]) == 6
    samples = {s["__key__"]: s for s in read_wds(out)}
    assert len(samples) == 6 * 2 + 2
    for key, sample in samples.items():
        arr = np.load(io.BytesIO(sample["npy"]), allow_pickle=False)
        assert arr.dtype == np.float32 and arr.ndim == 2 and arr.shape[1] == 3
        assert m["classes"][key.split("_")[0]] == int(sample["cls"])
    np.testing.assert_allclose(np.load(io.BytesIO(samples["sphere_extra_ply"]["npy"])), pts,
                               atol=1e-5)
    np.testing.assert_allclose(np.load(io.BytesIO(samples["cube_extra_off"]["npy"])), pts,
                               atol=1e-5)


def test_reshard_existing_shards_to_new_limits(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, per_class=6)
    run_tool("make_shards", "imagefolder", src, tmp_path / "a", "--max-count", 5, check=True)
    pattern = str(tmp_path / "a" / "train-{000000..000002}.tar")
    run_tool("make_shards", "shards", pattern, tmp_path / "b", "--max-count", 4,
             "--prefix", "re", check=True)
    m = load_manifest(tmp_path / "b")
    assert [s["name"] for s in m["shards"]] == ["re-000000.tar", "re-000001.tar", "re-000002.tar"]
    assert m["modality"] == "image" and m["total_samples"] == 12

    def content(name: str) -> list[dict]:
        return [{k: v for k, v in s.items() if k == "__key__" or not k.startswith("__")}
                for s in read_wds(tmp_path / name)]

    assert content("a") == content("b")


def test_same_input_gives_byte_identical_shards(tmp_path):
    # 40 images: 3 chunks of 16, so both workers send images by their path (FileRef)
    src = make_image_folder(tmp_path / "src", classes=2, per_class=20)
    for name, workers in (("x", 1), ("y", 2)):
        run_tool("make_shards", "imagefolder", src, tmp_path / name, "--max-count", 7,
                 "--workers", workers, check=True)
    for a, b in zip(shard_paths(tmp_path / "x"), shard_paths(tmp_path / "y"), strict=True):
        assert a.read_bytes() == b.read_bytes()
        assert a.with_suffix(".idx").read_bytes() == b.with_suffix(".idx").read_bytes()


def test_shuffle_seed_spreads_samples_reproducibly(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, per_class=10)

    def keys(name: str, *extra: object) -> list[str]:
        run_tool("make_shards", "imagefolder", src, tmp_path / name, "--max-count", 5, *extra,
                 check=True)
        return [s["__key__"] for s in read_wds(tmp_path / name)]

    plain, s1, s1b, s2 = keys("p"), keys("s1", "--shuffle-seed", 1), keys(
        "s1b", "--shuffle-seed", 1), keys("s2", "--shuffle-seed", 2)
    assert plain == sorted(plain) and s1 == s1b and s1 != plain and s1 != s2
    assert sorted(s1) == sorted(plain)
    first_shard_labels = {k.split("_")[0] for k in s1[:5]}
    assert len(first_shard_labels) == 2  # both classes mixed into the first shard


def test_size_limit_is_respected(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, per_class=10)
    run_tool("make_shards", "imagefolder", src, tmp_path / "o", "--max-size", "20KB",
             check=True)
    sizes = [p.stat().st_size for p in shard_paths(tmp_path / "o")]
    assert len(sizes) > 2 and max(sizes) <= 20_000
    assert load_manifest(tmp_path / "o")["total_samples"] == 20


def test_the_folder_walk_lists_in_pathlibs_order_and_names_what_it_passes_over(
        tmp_path, monkeypatch):
    import os

    from shardflow.convert import sources

    root = tmp_path / "src"
    for rel in ("a/b.jpg", "a.b/c.jpg", "a-b/x.jpg", "A/y.jpg", "ü/z.jpg", ".hidden/h.jpg",
                "a/.dot.jpg", "a/b/c/d.jpg", "a b/e.jpg", "a/b.JPG", "a/b0.jpg", "deny/q.jpg"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (root / "a" / "link.jpg").symlink_to(root / "a" / "b.jpg")
    (root / "linkdir").symlink_to(root / "a", target_is_directory=True)
    os.mkfifo(root / "a" / "pipe.jpg")
    # What pathlib's sorted rglob gave (the walk before this one), the unreadable folder apart.
    want, passed = [], []
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            passed.append((str(p), "symlink"))
        elif p.is_file():
            want.append(p.relative_to(root).as_posix())
        elif not p.is_dir():
            passed.append((str(p), "not-a-regular-file"))
    real = os.scandir

    def scandir(path):  # tests run as root, whom chmod does not stop
        if str(path).endswith("deny"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(sources.os, "scandir", scandir)
    files, ignored = sources._walk(root)
    assert files == [f for f in want if not f.startswith("deny/")]
    assert sorted((i["source"], i["reason"]) for i in ignored) == sorted(
        passed + [(str(root / "deny"), "unreadable-folder")])


def test_a_file_over_max_file_size_is_refused_naming_it_and_one_at_the_limit_kept(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=1, per_class=3)
    files = sorted(src.rglob("*.jpg"))
    limit = max(f.stat().st_size for f in files[:2])  # one of them exactly at the limit
    big = jpeg_bytes(7, size=(96, 80))
    assert len(big) > limit
    files[2].write_bytes(big)
    refused = run_tool("make_shards", "imagefolder", src, tmp_path / "o", "--max-file-size",
                       str(limit))
    assert refused.returncode != 0 and "file-too-large" in refused.stderr
    assert files[2].name in refused.stderr
    run_tool("make_shards", "imagefolder", src, tmp_path / "s", "--max-file-size", str(limit),
             "--on-error", "skip", check=True)
    m = load_manifest(tmp_path / "s")
    assert m["total_samples"] == 2 and m["skipped_counts"] == {"file-too-large": 1}
    assert files[2].name in json.dumps(m["skipped"])


def test_a_local_file_that_grows_while_read_is_read_to_its_end(tmp_path, monkeypatch):
    from shardflow.convert import sources
    from shardflow.errors import DataError

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 40)
    real = sources.os.fstat

    def stale(fd):  # the size taken before the file grew to what is on disk now
        st = real(fd)
        return type("Stat", (), {"st_size": st.st_size - 1000})()

    monkeypatch.setattr(sources.os, "fstat", stale)
    assert sources._read_file(str(path), 1 << 20, {}) == path.read_bytes()
    with pytest.raises(DataError, match="max_file_bytes=10000"):
        sources._read_file(str(path), 10_000, {})


def test_refuses_existing_shards_unless_overwrite(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=1, per_class=2)
    run_tool("make_shards", "imagefolder", src, tmp_path / "o", check=True)
    again = run_tool("make_shards", "imagefolder", src, tmp_path / "o")
    assert again.returncode != 0 and "--overwrite" in again.stderr
    other = tmp_path / "other"
    other.mkdir()
    (other / "data-000000.tar").write_bytes(b"x" * 1024)
    refused = run_tool("make_shards", "imagefolder", src, other)
    assert refused.returncode != 0 and "data-000000.tar" in refused.stderr
    run_tool("make_shards", "imagefolder", src, other, "--overwrite", check=True)
    assert not (other / "data-000000.tar").exists()
    assert load_manifest(other)["total_samples"] == 2


def test_parts_then_merge_equal_one_conversion(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=3, per_class=4)
    out = tmp_path / "parts"
    for i in range(3):
        run_tool("make_shards", "imagefolder", src, out, "--part", f"{i}/3", "--max-count", 3,
                 check=True)
    early = run_tool("make_shards", "merge", tmp_path / "src")
    assert early.returncode != 0
    run_tool("make_shards", "merge", out, check=True)
    merged = load_manifest(out)
    assert merged["total_samples"] == 12 and merged["classes"]["class2"] == 2
    keys = [s["__key__"] for s in read_wds(out)]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 12
    assert all(s["name"].startswith("train-p00") for s in merged["shards"])
    assert run_tool("verify_shards", out).returncode == 0


def test_keys_are_safe_unique_and_stable(tmp_path):
    src = tmp_path / "src" / "a.b c"
    src.mkdir(parents=True)
    for name in ("x.1.jpg", "x.1.png", "x_1.jpg", "ünï.jpg"):
        fmt = "PNG" if name.endswith("png") else "JPEG"
        (src / name).write_bytes(jpeg_bytes(len(name), fmt=fmt))
    run_tool("make_shards", "imagefolder", tmp_path / "src", tmp_path / "o", check=True)
    keys = [s["__key__"] for s in read_wds(tmp_path / "o")]
    assert len(set(keys)) == 4
    assert all("." not in k and "/" not in k and " " not in k for k in keys)
    run_tool("make_shards", "imagefolder", tmp_path / "src", tmp_path / "o2", check=True)
    assert keys == [s["__key__"] for s in read_wds(tmp_path / "o2")]


@pytest.mark.parametrize("bad_args, option", [
    (["--max-count", "0"], "--max-count"), (["--max-size", "lots"], "--max-size"),
    (["--part", "3/3"], "--part"), (["--bogus"], "--bogus"), (["--on-error", "ignore"],
                                                              "--on-error"),
])
def test_invalid_options_are_named(tmp_path, bad_args, option):
    proc = run_tool("make_shards", "imagefolder", tmp_path, tmp_path / "o", *bad_args)
    assert proc.returncode == 2 and option in proc.stderr


def test_classes_from_numbers_a_validation_split_like_training(tmp_path):
    train = make_image_folder(tmp_path / "train", classes=3, per_class=2)
    val = tmp_path / "val"
    (val / "class2").mkdir(parents=True)
    (val / "class2" / "v.jpg").write_bytes(jpeg_bytes(99))
    run_tool("make_shards", "imagefolder", train, tmp_path / "t", check=True)
    run_tool("make_shards", "imagefolder", val, tmp_path / "v", "--classes-from",
             tmp_path / "t" / "manifest.json", check=True)
    assert [int(s["cls"]) for s in read_wds(tmp_path / "v")] == [2]
    assert load_manifest(tmp_path / "v")["classes"] == load_manifest(tmp_path / "t")["classes"]
    (val / "class9").mkdir()
    refused = run_tool("make_shards", "imagefolder", val, tmp_path / "v2", "--classes-from",
                       tmp_path / "t" / "manifest.json")
    assert refused.returncode == 2 and "class9" in refused.stderr


def test_symlinks_are_not_followed_but_listed(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=1, per_class=2)
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(jpeg_bytes(5))
    (src / "class0" / "link.jpg").symlink_to(secret)
    run_tool("make_shards", "imagefolder", src, tmp_path / "o", check=True)
    m = load_manifest(tmp_path / "o")
    assert m["total_samples"] == 2
    assert {"source": str(src / "class0" / "link.jpg"), "reason": "symlink"} in m["ignored"]


def test_big_line_files_are_cut_into_ranges_without_losing_a_line(tmp_path, monkeypatch):
    from shardflow.convert import ConvertConfig, convert, sources
    from shardflow.convert.sources import TextOptions

    monkeypatch.setattr(sources, "TEXT_RANGE_BYTES", 64)
    lines = [f"line {i} " + "x" * (i % 17) for i in range(200)]
    (tmp_path / "big.txt").write_text("\n".join(lines) + "\n")
    cfg = ConvertConfig(kind="text", src=str(tmp_path / "big.txt"), out=tmp_path / "o",
                        workers=1, text=TextOptions(split_lines=True), max_count=50)
    assert convert(cfg).total_samples == 200
    assert [s["txt"].decode() for s in read_wds(tmp_path / "o")] == lines


def test_failed_run_can_be_finished_with_skip_without_overwrite(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, per_class=6)
    (src / "class1" / "zz_bad.jpg").write_bytes(b"not an image")
    out = tmp_path / "o"
    failed = run_tool("make_shards", "imagefolder", src, out, "--max-count", 3, "--workers", 1)
    assert failed.returncode == 1 and "zz_bad" in failed.stderr and "bad-image" in failed.stderr
    assert len(list(out.glob("*.tar"))) >= 2  # the shards finished before the error are kept
    run_tool("make_shards", "imagefolder", src, out, "--max-count", 3, "--on-error", "skip",
             check=True)
    m = load_manifest(out)
    assert m["total_samples"] == 12 and m["skipped_counts"] == {"bad-image": 1}


def test_merge_refuses_parts_made_with_other_arguments(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, per_class=3)
    out = tmp_path / "parts"
    run_tool("make_shards", "imagefolder", src, out, "--part", "0/2", check=True)
    run_tool("make_shards", "imagefolder", src, out, "--part", "1/2", "--shuffle-seed", 4,
             check=True)
    merged = run_tool("make_shards", "merge", out)
    assert merged.returncode == 2 and "shuffle_seed" in merged.stderr


def test_verify_finds_a_key_in_two_shards(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=1, per_class=2)
    run_tool("make_shards", "imagefolder", src, tmp_path / "a", check=True)
    run_tool("make_shards", "imagefolder", src, tmp_path / "b", "--prefix", "copy", check=True)
    both = str(tmp_path / "{a/train,b/copy}-000000.tar")
    proc = run_tool("verify_shards", both)
    assert proc.returncode == 1 and "duplicate-key" in proc.stdout


def test_an_image_sent_by_its_path_is_written_as_its_bytes_and_refused_once_changed(tmp_path):
    """With several workers, an image kept as stored travels as a FileRef (its path and
    stamp), read again by the process writing shards: the same tar bytes as the image's
    bytes, and a file changed after its check is bad input (on_error), never written."""
    import os

    from shardflow.convert.sources import InputItem, TextOptions, build_samples
    from shardflow.errors import DataError
    from shardflow.samples.checks import CheckLimits
    from shardflow.samples.downsize import Downsize
    from shardflow.shards.writer import FileRef, pack

    path = tmp_path / "a.jpg"
    path.write_bytes(jpeg_bytes(1))
    item = InputItem("a", str(path), "image", 1)

    def built(refs: bool, limits: CheckLimits | None = None) -> dict:
        (sample,) = build_samples(item, limits or CheckLimits(), TextOptions(), 10**8,
                                  refs=refs)
        return sample

    # A worker of a conversion with several makes one; one worker, or a resized image, not.
    assert isinstance(built(True)["jpg"], FileRef)
    assert built(False)["jpg"] == path.read_bytes()
    assert isinstance(built(True, CheckLimits(downsize=Downsize(8)))["jpg"], bytes)
    ref = pack(built(True))
    inline = pack(built(False))
    assert ref.size == inline.size and ref.members == inline.members
    assert b"".join(bytes(p) for p in ref.resolved().parts) == b"".join(inline.parts)
    # The same size and the old mtime back (cp -p, rsync -t): the ctime still moved.
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataError, match="changed after it was checked") as err:
        ref.resolved()
    assert err.value.reason == "file-changed" and str(path) in str(err.value)
    path.unlink()
    with pytest.raises(DataError, match="went away"):
        ref.resolved()


def test_a_script_read_from_stdin_converts_with_worker_processes(tmp_path):
    """Workers run the main script again from its file; `python -` names "<stdin>", which is
    no file (every worker died of it)."""
    import subprocess
    import sys


    src = make_image_folder(tmp_path / "src", classes=2, per_class=20)  # 3 chunks: 2 workers
    script = ("from shardflow.convert import ConvertConfig, convert\n"
              f"m = convert(ConvertConfig(kind='imagefolder', src={str(src)!r}, "
              f"out={str(tmp_path / 'out')!r}, max_count=4, workers=2))\n"
              "print('samples', sum(s.samples for s in m.shards))\n")
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "samples 40" in done.stdout
