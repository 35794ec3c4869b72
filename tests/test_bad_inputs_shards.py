"""Every case of shared/BAD_INPUTS.md the shard tools can meet, built as real files per test.

make_shards (each source kind), verify_shards and the library reader `iter_samples`, under
both policies: `raise` stops, naming the file or shard, the key and the reason code; `skip`
finishes, lists each skipped input with its reason in manifest.json, counts it, and
converted + skipped == inputs. Nothing is unpickled, no member name becomes a path, no secret
is echoed, nothing hangs.

The CLI is run as a subprocess where its exit code or text is the point; the many one-bad-input
`raise` cases call `shardflow.convert.convert` in-process (what the CLI prints is `str(err)`).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from badfiles import (
    ABSURD,
    HTML_PAGE,
    Payload,
    declare_size,
    member_info,
    npy_bytes,
    png16,
    png_declaring,
    special,
    tar_bytes,
)
from conftest import ROOT, jpeg_bytes, load_manifest, make_image_folder, run_tool
from PIL import Image

from shardflow.convert import ConvertConfig, convert
from shardflow.errors import DataError, SkipLog
from shardflow.samples.checks import CheckLimits, check_image
from shardflow.shards.manifest import Manifest
from shardflow.shards.tarread import iter_samples
from shardflow.shards.verify import verify
from shardflow.shards.writer import ShardWriter


def rows(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


# -- running and reading back ------------------------------------------------------------------

def make(kind: str, src: object, out: Path, *args: object) -> subprocess.CompletedProcess[str]:
    return run_tool("make_shards", kind, src, out, "--workers", 1, "--quiet", *args)


def run_bounded(cmds: list[list[str]], timeout: float, cwd: Path | None = None
                ) -> list[tuple[int | None, str]]:
    """Run commands side by side; (exit code or None when killed at the deadline, output)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=cwd) for c in cmds]
    deadline, results = time.monotonic() + timeout, []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, out))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            results.append((None, out))
    return results


def tool_cmd(name: str, *args: object) -> list[str]:
    return [sys.executable, str(ROOT / "tools" / f"{name}.py"), *map(str, args)]


def in_process(kind: str, src: object, out: Path, on_error: str = "raise", **kw: object
               ) -> Manifest:
    cfg = ConvertConfig(kind=kind, src=str(src), out=out, on_error=on_error,
                        workers=1, **kw)
    return convert(cfg)


def expect_raise(kind: str, src: object, out: Path, **kw: object) -> DataError:
    """`raise` policy: the first bad input stops the job and nothing is left under a name."""
    with pytest.raises(DataError) as info:
        in_process(kind, src, out, **kw)
    assert not list(out.glob("*.tar")) and not (out / "manifest.json").exists()
    return info.value


def read_shard(data: bytes, url: str = "mem.tar", policy: str = "raise"):
    """(samples, skip entries, DataError or None) of iter_samples over one shard's bytes."""
    skips, samples, error = SkipLog(announce=False), [], None
    try:
        samples.extend(iter_samples(io.BytesIO(data), url, on_error=policy,
                                    skips=skips))
    except DataError as err:
        error = err
    return samples, skips.entries, error


def output(out: Path) -> dict[str, dict]:
    """Every converted sample by key, read back from the manifest's shards."""
    found: dict[str, dict] = {}
    for s in load_manifest(out)["shards"]:
        with open(out / s["name"], "rb") as f:
            for sample in iter_samples(f, s["name"]):
                assert sample["__key__"] not in found, "a key appears twice in the output"
                found[str(sample["__key__"])] = sample
    return found


def skip_report(out: Path, inputs: int, stdout: str) -> dict[str, tuple[str, str]]:
    """Check the skip report of a finished `skip` run; {source file name: (key, reason)}."""
    m = load_manifest(out)
    reasons = Counter(e["reason"] for e in m["skipped"])
    assert m["skipped_counts"] == dict(reasons)
    assert m["total_samples"] + len(m["skipped"]) == inputs
    if m["skipped"]:
        assert f"skipped {len(m['skipped'])} inputs" in stdout
        assert all(f"{r}={n}" in stdout for r, n in reasons.items())
    return {Path(e["source"]).name: (e["key"], e["reason"]) for e in m["skipped"]}


def line_refs(path: Path) -> dict[int, set[str]]:
    """{line number: the ways a skip entry may point at that line (path:N or path@OFFSET)}."""
    refs, offset = {}, 0
    for n, line in enumerate(path.read_bytes().splitlines(keepends=True), 1):
        refs[n] = {f"{path}:{n}", f"{path}@{offset}"}
        offset += len(line)
    return refs


def files_under(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def assert_names(err: DataError, where: str, key: str, reason: str) -> None:
    text = str(err)
    assert where in text and f"[{reason}]" in text and err.reason == reason
    if key:
        assert repr(key) in text


# == shard files ===============================================================================

def bad_shards(root: Path, marker: Path) -> dict[str, list[tuple[str, str]]]:
    """Write one shard per bad case into `root`; {shard: [(key, reason) expected]}."""
    root.mkdir(parents=True, exist_ok=True)
    escape_abs = str(root.parent / "shardflow-evil-abs")
    truncated = tar_bytes([("t-a.txt", b"t" * 3000), ("t-a.cls", b"0")])
    cases: dict[str, tuple[bytes, list[tuple[str, str]]]] = {
        "truncated.tar": (truncated[:member_info(truncated, "t-a.txt").offset_data + 1000],
                          [("", "truncated")]),
        "empty.tar": (b"", [("", "empty-shard")]),
        "html.tar": (HTML_PAGE, [("", "not-a-tar")]),
        "dupkey.tar": (tar_bytes([("d-a.txt", b"first"), ("d-a.cls", b"0"), ("d-b.txt", b"b"),
                                  ("d-b.cls", b"1"), ("d-a.txt", b"again"), ("d-a.cls", b"0")]),
                       [("d-a", "split-key")]),
        "splitkey.tar": (tar_bytes([("s-a.txt", b"a"), ("s-b.txt", b"b"), ("s-b.cls", b"1"),
                                    ("s-a.cls", b"0")]), [("s-a", "split-key")]),
        "unsafe.tar": (tar_bytes([
            ("u-ok.txt", b"fine"), ("../shardflow-evil-dotdot.txt", b"evil"),
            (escape_abs + ".txt", b"evil"),
            special("u-sym.txt", tarfile.SYMTYPE, "/etc/passwd"),
            special("u-hard.txt", tarfile.LNKTYPE, "u-ok.txt"),
            special("u-fifo.txt", tarfile.FIFOTYPE), special("u-dev.txt", tarfile.CHRTYPE)]),
            [("../shardflow-evil-dotdot", "unsafe-member-name"),
             (escape_abs, "unsafe-member-name"), ("u-sym", "not-a-regular-file"),
             ("u-hard", "not-a-regular-file"), ("u-fifo", "not-a-regular-file"),
             ("u-dev", "not-a-regular-file")]),
        "pickles.tar": (tar_bytes([m for ext in ("pkl", "pickle", "pth", "pyd") for m in (
            (f"p-{ext}.txt", b"caption"), (f"p-{ext}.{ext}", pickle.dumps(Payload(marker))))]),
            [(f"p-{ext}", "pickle-member") for ext in ("pkl", "pickle", "pth", "pyd")]),
        "objnpy.tar": (tar_bytes([("o-a.npy", npy_bytes(np.array([Payload(marker)], object)))]),
                       [("o-a", "object-dtype")]),
        "badlabel.tar": (tar_bytes([("l-a.txt", b"labelled"), ("l-a.cls", b"cat")]),
                         [("l-a", "bad-label")]),
    }
    for name, (data, _) in cases.items():
        (root / name).write_bytes(data)
    return {name: expected for name, (_, expected) in cases.items()}


GOOD_SHARD = [(f"g-{i}.{ext}", data) for i in range(3)
              for ext, data in (("cls", str(i).encode()), ("txt", f"good {i}".encode()))]
REFUSED_KEYS = {"t-a", "u-sym", "u-hard", "u-fifo", "u-dev", "o-a", "l-a",
                "p-pkl", "p-pickle", "p-pth", "p-pyd"}


def test_payload_would_run_if_unpickled(tmp_path):
    """The pickles used below are live: loading one creates its marker."""
    pickle.loads(pickle.dumps(Payload(tmp_path / "proof")))  # the one deliberate unpickle
    assert (tmp_path / "proof").exists()


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("shard", ["truncated.tar", "empty.tar", "html.tar"])
def test_iter_samples_shard_damage_names_shard_and_reason(tmp_path, shard, policy):
    expected = bad_shards(tmp_path / "s", tmp_path / "marker")[shard]
    samples, skipped, err = read_shard((tmp_path / "s" / shard).read_bytes(), shard, policy)
    assert samples == [] and skipped == [] and err is not None  # shard-level: always raised
    assert_names(err, shard, "", expected[0][1])


@pytest.mark.parametrize("shard", ["dupkey.tar", "splitkey.tar"])
def test_iter_samples_key_seen_twice(tmp_path, shard):
    expected = bad_shards(tmp_path / "s", tmp_path / "marker")[shard]
    raw = (tmp_path / "s" / shard).read_bytes()
    _, _, err = read_shard(raw, shard, "raise")
    assert_names(err, shard, expected[0][0], "split-key")
    samples, skipped, err = read_shard(raw, shard, "skip")
    assert err is None
    assert [(e["key"], e["reason"]) for e in skipped] == expected
    if shard == "dupkey.tar":  # the first copy is kept whole, the second dropped and named
        assert [(s["__key__"], s["txt"]) for s in samples] == [("d-a", b"first"), ("d-b", b"b")]


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_iter_samples_refuses_links_devices_and_escaping_names(tmp_path, policy):
    expected = bad_shards(tmp_path / "s", tmp_path / "marker")["unsafe.tar"]
    before = files_under(tmp_path.parent)
    samples, skipped, err = read_shard((tmp_path / "s" / "unsafe.tar").read_bytes(),
                                       "unsafe.tar", policy)
    if policy == "raise":
        assert_names(err, "unsafe.tar", *expected[0])
    else:
        assert err is None and [(e["key"], e["reason"]) for e in skipped] == expected
        assert [(s["__key__"], s["txt"]) for s in samples] == [("u-ok", b"fine")]
    assert files_under(tmp_path.parent) == before  # no member name was used as a path


def test_iter_samples_never_unpickles(tmp_path):
    marker = tmp_path / "marker"
    bad_shards(tmp_path / "s", marker)
    for shard in ("pickles.tar", "objnpy.tar"):
        raw = (tmp_path / "s" / shard).read_bytes()
        samples, _, err = read_shard(raw, shard)
        assert err is None and samples  # bytes pass through untouched; checks refuse them
        assert all(isinstance(v, bytes) for s in samples for k, v in s.items()
                   if not k.startswith("__"))
    assert not marker.exists()


def test_make_shards_skip_over_every_bad_shard(tmp_path):
    src, out, marker = tmp_path / "src", tmp_path / "out", tmp_path / "marker"
    expected = bad_shards(src, marker)
    (src / "good.tar").write_bytes(tar_bytes(GOOD_SHARD))
    before = files_under(tmp_path.parent)
    proc = make("shards", src, out, "--on-error", "skip")
    assert proc.returncode == 0, proc.stderr
    m = load_manifest(out)
    got = {(Path(e["source"]).name, e["key"], e["reason"]) for e in m["skipped"]}
    # make_shards puts a key's members back together (tarread.iter_regrouped): a key whose
    # members lie apart is converted whole, not skipped as the loaders skip it
    want = {(shard, key, reason) for shard, pairs in expected.items() for key, reason in pairs
            if key and shard != "splitkey.tar"}
    assert want <= got and not any(shard == "splitkey.tar" for shard, _, _ in got)
    for shard in ("truncated.tar", "empty.tar", "html.tar"):
        assert (shard, expected[shard][0][1]) in {(s, r) for s, _, r in got}
    assert m["skipped_counts"] == dict(Counter(e["reason"] for e in m["skipped"]))
    assert "every skipped input is listed" in proc.stdout
    samples = output(out)
    for i in range(3):
        assert samples[f"g-{i}"]["txt"] == f"good {i}".encode()
        assert samples[f"g-{i}"]["cls"] == str(i).encode()
    assert samples["u-ok"]["txt"] == b"fine" and samples["d-a"]["txt"] == b"first"
    assert "s-b" in samples and "d-b" in samples
    assert (samples["s-a"]["txt"], samples["s-a"]["cls"]) == (b"a", b"0")  # members apart
    assert not REFUSED_KEYS & set(samples)
    assert not any("evil" in k for k in samples)
    assert not marker.exists()
    new = files_under(tmp_path.parent) - before  # member names were never used as paths
    assert all(out in p.parents or p == out for p in new), sorted(new)
    assert not (Path.cwd().parent / "shardflow-evil-dotdot.txt").exists()


@pytest.mark.parametrize("shard", ["truncated.tar", "empty.tar", "html.tar", "dupkey.tar",
                                   "splitkey.tar", "unsafe.tar", "pickles.tar", "objnpy.tar",
                                   "badlabel.tar"])
def test_make_shards_raise_stops_at_bad_shard(tmp_path, shard):
    marker = tmp_path / "marker"
    expected = bad_shards(tmp_path / "all", marker)[shard][0]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a-good.tar").write_bytes(tar_bytes(GOOD_SHARD))
    (tmp_path / "all" / shard).rename(src / shard)
    if shard == "splitkey.tar":  # make_shards puts a key's members back together
        convert_ok = make("shards", src, tmp_path / "out")
        assert convert_ok.returncode == 0 and load_manifest(tmp_path / "out")["skipped"] == []
        return
    err = expect_raise("shards", src, tmp_path / "out")
    assert_names(err, str(src / shard), *expected)
    assert not marker.exists()


def test_make_shards_cli_raise_exit_and_message(tmp_path):
    marker = tmp_path / "marker"
    bad_shards(tmp_path / "src", marker)
    proc = make("shards", tmp_path / "src" / "pickles.tar", tmp_path / "out")
    assert proc.returncode == 1
    assert "pickles.tar key 'p-pkl'" in proc.stderr and "[pickle-member]" in proc.stderr
    assert "--on-error skip" in proc.stderr
    assert not marker.exists() and not list((tmp_path / "out").glob("*.tar"))


def test_verify_shards_names_every_bad_shard(tmp_path):
    folder, marker = tmp_path / "shards", tmp_path / "marker"
    expected = bad_shards(folder, marker)
    reports, manifest = verify(str(folder))
    assert manifest is None
    found = {Path(r.url).name: {(p["key"], p["reason"]) for p in r.problems} for r in reports}
    assert set(found) == set(expected)
    for shard, pairs in expected.items():
        missing_key = {(k, r) for k, r in pairs if k} - found[shard]
        assert not missing_key, (shard, found[shard])
        assert {r for _, r in pairs} <= {r for _, r in found[shard]}
        assert ("", "missing-index") in found[shard]
    proc = run_tool("verify_shards", folder, "--jobs", 1)
    assert proc.returncode == 1
    reasons = {r for pairs in expected.values() for _, r in pairs} | {"missing-index"}
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("problems by"))
    assert all(f"{r}=" in summary for r in reasons)
    assert not marker.exists()


# -- a member declaring an absurd size ---------------------------------------------------------

def absurd_shard() -> bytes:
    good = tar_bytes([("x-a.txt", b"a"), ("x-b.txt", b"b"), ("x-c.txt", b"c")])
    return declare_size(good, "x-b.txt", ABSURD)


def test_absurd_member_size_refused_without_allocating(tmp_path):
    data = absurd_shard()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        _, _, err = read_shard(data, "absurd.tar")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 2 and peak < 16 * 2**20
    assert_names(err, "absurd.tar", "x-b", "member-too-large")
    assert str(ABSURD) in str(err)
    (tmp_path / "absurd.tar").write_bytes(data)
    proc = make("shards", tmp_path / "absurd.tar", tmp_path / "out")
    assert proc.returncode == 1
    assert "absurd.tar key 'x-b'" in proc.stderr and "[member-too-large]" in proc.stderr


def test_absurd_member_size_under_skip_does_not_hang(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "absurd.tar").write_bytes(absurd_shard())
    reader = ("import sys; from shardflow.shards.tarread import iter_samples; "
              "from shardflow.errors import SkipLog, DataError\n"
              "s = SkipLog(announce=False)\n"
              "try:\n list(iter_samples(open(sys.argv[1], 'rb'), 'a', on_error='skip', skips=s))\n"
              "except DataError as e:\n print(e)\n"
              "print([e['reason'] for e in s.entries])")
    (made, made_out), (checked, checked_out), (read, read_out) = run_bounded([
        tool_cmd("make_shards", "shards", tmp_path / "src", tmp_path / "out", "--workers", 1,
                 "--quiet", "--on-error", "skip"),
        tool_cmd("verify_shards", tmp_path / "src", "--jobs", 1),
        [sys.executable, "-c", reader, str(tmp_path / "src" / "absurd.tar")],
    ], timeout=3, cwd=ROOT)
    assert read == 0 and "member-too-large" in read_out
    assert checked == 1 and "[member-too-large]" in checked_out
    assert made == 0
    skipped = load_manifest(tmp_path / "out")["skipped"]
    assert ("x-b", "member-too-large") in {(e["key"], e["reason"]) for e in skipped}


# -- damage the reader must not take for a clean end -------------------------------------------

def _damaged(case: str) -> bytes:
    data = tar_bytes([("k-a.txt", b"a" * 600), ("k-a.cls", b"0"), ("k-b.txt", b"b" * 600),
                      ("k-b.cls", b"1"), ("k-c.txt", b"c"), ("k-c.cls", b"2")])
    b_header = member_info(data, "k-b.txt").offset
    if case == "cut-inside-a-header":
        return data[:b_header + 300]
    damaged = bytearray(data)
    damaged[b_header + 3] ^= 0x55  # the member name: the header checksum no longer matches
    return bytes(damaged)


@pytest.mark.parametrize("case", ["cut-inside-a-header", "corrupt-header-in-the-middle"])
def test_damaged_header_is_an_error_not_the_end(case):
    samples, _, err = read_shard(_damaged(case), "damaged.tar")
    assert err is not None and "damaged.tar" in str(err), [s["__key__"] for s in samples]


def test_corrupted_gzip_shard_is_an_error():
    payload = np.random.default_rng(3).bytes(4000)
    gz = bytearray(gzip.compress(tar_bytes([("z-a.bin", payload), ("z-a.cls", b"0")]),
                                 compresslevel=0, mtime=0))  # stored blocks: bytes as they are
    pos = bytes(gz).find(payload[2000:2040])
    assert pos > 0
    gz[pos] ^= 0x01
    samples, _, err = read_shard(bytes(gz), "bitrot.tar.gz")
    assert err is not None, f"corrupted bytes passed: {samples[0]['bin'] != payload}"


def test_truncated_shard_keeps_complete_samples_before_the_cut(tmp_path):
    data = tar_bytes([("c-a.txt", b"all here"), ("c-a.cls", b"0"), ("c-b.txt", b"b" * 3000),
                      ("c-b.cls", b"1")])
    src = tmp_path / "cut.tar"
    src.write_bytes(data[:member_info(data, "c-b.txt").offset_data + 1000])
    m = in_process("shards", src, tmp_path / "out", on_error="skip")
    assert [(e["reason"]) for e in m.skipped] == ["truncated"]
    assert set(output(tmp_path / "out")) == {"c-a"}


def test_refused_member_drops_its_whole_sample(tmp_path):
    src = tmp_path / "s.tar"
    src.write_bytes(tar_bytes([
        ("m-ok.cls", b"0"), ("m-ok.txt", b"fine"),
        ("m-link.cls", b"1"), special("m-link.txt", tarfile.SYMTYPE, "/etc/passwd"),
        ("m-big.cls", b"2"), ("m-big.txt", b"x" * 5000)]))
    m = in_process("shards", src, tmp_path / "out", on_error="skip", max_member_bytes=1024)
    assert {(e["key"], e["reason"]) for e in m.skipped} == {
        ("m-link", "not-a-regular-file"), ("m-big", "member-too-large")}
    samples = output(tmp_path / "out")
    assert all({"txt", "cls"} <= set(s) for s in samples.values()), sorted(samples)
    assert m.total_samples + len(m.skipped) == 3


def test_split_key_fragment_is_not_converted_alone(tmp_path):
    bad_shards(tmp_path / "src", tmp_path / "marker")
    m = in_process("shards", tmp_path / "src" / "splitkey.tar", tmp_path / "out",
                   on_error="skip")
    samples = output(tmp_path / "out")
    assert all({"txt", "cls"} <= set(s) for s in samples.values()), sorted(samples)
    assert m.total_samples + len(m.skipped) == 2


# -- missing shards, compressed shards ---------------------------------------------------------

@pytest.mark.parametrize("pattern, policy, missing", [
    ("good-{000000..000003}.tar", "raise", ["000002", "000003"]),  # a range too long
    ("good-{00000..00003}.tar", "skip", ["00000", "00001", "00002", "00003"]),  # digit short
])
def test_missing_shards_one_preflight_error_listing_all(tmp_path, pattern, policy, missing):
    (tmp_path / "good-000000.tar").write_bytes(tar_bytes(GOOD_SHARD))
    (tmp_path / "good-000001.tar").write_bytes(tar_bytes(GOOD_SHARD))
    missing = [f"good-{n}.tar" for n in missing]
    proc = make("shards", tmp_path / pattern, tmp_path / "out", "--on-error", policy)
    assert proc.returncode == 2
    assert proc.stderr.count("error:") == 1
    assert f"{len(missing)} of 4 shards are missing" in proc.stderr
    assert all(str(tmp_path / n) in proc.stderr for n in missing)
    assert not list((tmp_path / "out").glob("*.tar"))


def test_verify_lists_every_missing_shard(tmp_path):
    (tmp_path / "good-000000.tar").write_bytes(tar_bytes(GOOD_SHARD))
    proc = run_tool("verify_shards", tmp_path / "good-{000000..000002}.tar", "--jobs", 1)
    assert proc.returncode == 1
    for n in ("good-000001.tar", "good-000002.tar"):
        assert f"{tmp_path / n}: the shard does not exist [missing-shard]" in proc.stdout


def test_gzip_shard_read_and_gz_member_expanded_within_the_limit(tmp_path):
    """A `.gz` member is expanded (as webdataset's decoder does), never past the member limit:
    beyond it the sample is refused, naming shard and key, and nothing larger is allocated."""
    bomb = gzip.compress(b"\0" * 4_000_000, mtime=0)  # 4 MB of zeros in about 4 KB
    src = tmp_path / "src"
    src.mkdir()
    (src / "zipped.tar.gz").write_bytes(gzip.compress(tar_bytes(
        [("z-a.txt", b"inside gzip"), ("z-a.blob.gz", bomb),
         ("z-b.txt.gz", gzip.compress(b"two", mtime=0))]), mtime=0))
    samples, _, err = read_shard((src / "zipped.tar.gz").read_bytes(), "zipped.tar.gz")
    assert err is None and [s["__key__"] for s in samples] == ["z-a", "z-b"]
    assert samples[0]["blob"] == b"\0" * 4_000_000 and samples[1]["txt"] == b"two"
    proc = make("shards", src, tmp_path / "raise", "--max-member-size", "64KiB")
    assert proc.returncode == 1 and "zipped.tar.gz key 'z-a'" in proc.stderr
    assert "[member-too-large]" in proc.stderr and "z-a.blob.gz" in proc.stderr
    proc = make("shards", src, tmp_path / "out", "--max-member-size", "64KiB", "--on-error",
                "skip")
    assert proc.returncode == 0, proc.stderr
    assert {k: s["txt"] for k, s in output(tmp_path / "out").items()} == {"z-b": b"two"}
    m = load_manifest(tmp_path / "out")
    assert m["total_samples"] == 1
    assert [(e["key"], e["reason"]) for e in m["skipped"]] == [("z-a", "member-too-large")]
    assert sum(p.stat().st_size for p in (tmp_path / "out").glob("*.tar")) < 100_000


# == images ====================================================================================

GOOD_IMAGES = {
    "one.png": lambda: jpeg_bytes(1, (1, 1), "RGB", "PNG"),
    "thin.jpg": lambda: jpeg_bytes(2, (1, 500), "RGB", "JPEG"),
    "gray.jpg": lambda: jpeg_bytes(3, (16, 12), "L", "JPEG"),
    "alpha.png": lambda: jpeg_bytes(4, (16, 12), "RGBA", "PNG"),
    "cmyk.jpg": lambda: jpeg_bytes(5, (16, 12), "CMYK", "JPEG"),
    "deep.png": png16,
    "anim.gif": lambda: jpeg_bytes(6, (16, 12), "P", "GIF"),
    "pic.bmp": lambda: jpeg_bytes(7, (16, 12), "RGB", "BMP"),
}
BAD_IMAGES = {
    "trunc.jpg": (lambda: jpeg_bytes(8, (64, 48))[:600], "bad-image"),
    "random.jpg": (lambda: np.random.default_rng(9).bytes(3000), "bad-image"),
    "bomb.png": (lambda: png_declaring(20_000, 20_000), "too-many-pixels"),
    "big.png": (lambda: jpeg_bytes(10, (40, 40), "RGB", "PNG"), "too-many-pixels"),  # > 1000 px
}


def image_source(root: Path, kind: str, bad: list[str], good: list[str]) -> tuple[Path, int]:
    """An imagefolder (good/ and bad/ classes) or a CSV manifest over the same files."""
    for folder, names, table in (("good", good, GOOD_IMAGES), ("bad", bad, BAD_IMAGES)):
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name in names:
            make_bytes = table[name] if folder == "good" else table[name][0]
            (root / folder / name).write_bytes(make_bytes())
    if kind == "imagefolder":
        return root, len(bad) + len(good)
    listed = [f"good/{n},1" for n in good] + [f"bad/{n},0" for n in bad]  # as the folders
    return rows(root / "list.csv", ["path,label", *listed]), len(listed)


def pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGBA"))


@pytest.mark.parametrize("kind", ["imagefolder", "manifest"])
def test_images_skip_bad_keep_odd_but_valid(tmp_path, kind):
    src, inputs = image_source(tmp_path / "src", kind, list(BAD_IMAGES), list(GOOD_IMAGES))
    if kind == "manifest":
        with open(src, "a") as f:
            f.write("nowhere/ghost.jpg,1\n")
        inputs += 1
    out = tmp_path / "out"
    proc = make(kind, src, out, "--on-error", "skip", "--max-pixels", 1000)
    assert proc.returncode == 0, proc.stderr
    skipped = skip_report(out, inputs, proc.stdout)
    want = {name: (f"bad_{name.split('.')[0]}", reason) for name, (_, reason) in
            BAD_IMAGES.items()}
    if kind == "manifest":
        want["ghost.jpg"] = ("nowhere_ghost", "missing-file")
    assert skipped == want
    samples = output(out)
    for name in GOOD_IMAGES:
        stem, ext = name.split(".")
        sample, original = samples[f"good_{stem}"], (tmp_path / "src" / "good" / name).read_bytes()
        assert sample["cls"] == b"1"
        if ext in ("jpg", "png", "bmp"):  # kept byte for byte (formats both backends read)
            assert sample[ext] == original
        else:  # GIF: re-encoded to PNG, same pixels
            assert "png" in sample and sample["png"][:8] == b"\x89PNG\r\n\x1a\n"
            assert np.array_equal(pixels(sample["png"]), pixels(original))


@pytest.mark.parametrize("kind", ["imagefolder", "manifest"])
@pytest.mark.parametrize("bad", list(BAD_IMAGES))
def test_images_raise_names_file_key_reason(tmp_path, kind, bad):
    src, _ = image_source(tmp_path / "src", kind, [bad], ["one.png"])
    err = expect_raise(kind, src, tmp_path / "out", limits=CheckLimits(max_pixels=1000))
    assert_names(err, str(tmp_path / "src" / "bad" / bad), f"bad_{bad.split('.')[0]}",
                 BAD_IMAGES[bad][1])


def test_manifest_missing_file_raise_cli(tmp_path):
    src, _ = image_source(tmp_path / "src", "manifest", [], ["one.png"])
    with open(src, "a") as f:
        f.write("nowhere/ghost.jpg,1\n")
    proc = make("manifest", src, tmp_path / "out")
    assert proc.returncode == 1
    assert f"{tmp_path / 'src' / 'nowhere' / 'ghost.jpg'} key 'nowhere_ghost'" in proc.stderr
    assert "[missing-file]" in proc.stderr


@pytest.mark.parametrize("width, height", [(20_000, 20_000), (9_000, 8_000)])
def test_decompression_bomb_rejected_before_allocation(tmp_path, width, height):
    data = png_declaring(width, height)  # 400 and 72 megapixels declared in about 100 bytes
    assert len(data) < 200
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as info:
            check_image(data, CheckLimits())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.reason == "too-many-pixels" and peak < 16 * 2**20
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "bomb.png").write_bytes(data)
    proc = make("imagefolder", tmp_path / "src", tmp_path / "out")
    assert proc.returncode == 1 and "key 'c_bomb'" in proc.stderr
    assert "[too-many-pixels]" in proc.stderr and "bomb.png" in proc.stderr


# == samples: labels and required fields =======================================================

@pytest.mark.parametrize("fmt, policy", [("csv", "raise"), ("jsonl", "skip")])
def test_manifest_row_without_label_is_named(tmp_path, fmt, policy):
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(1))
    (tmp_path / "b.jpg").write_bytes(jpeg_bytes(2))
    if fmt == "csv":
        src = rows(tmp_path / "m.csv", ["path,label", "a.jpg,0", "b.jpg,", "a.jpg,1"])
    else:
        src = rows(tmp_path / "m.jsonl", [json.dumps({"path": "a.jpg", "label": 0}),
                                          json.dumps({"path": "b.jpg", "label": None})])
    proc = make("manifest", src, tmp_path / "out", "--on-error", policy)
    assert proc.returncode == 2
    assert str(src) in proc.stderr and "row 2 has no label" in proc.stderr
    assert not list((tmp_path / "out").glob("*.tar"))


def test_manifest_integer_labels_with_a_bad_one_are_not_renumbered(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.jpg").write_bytes(jpeg_bytes(ord(name)))
    src = rows(tmp_path / "m.csv", ["path,label", "a.jpg,0", "b.jpg,1", "c.jpg,-1"])
    proc = make("manifest", src, tmp_path / "out")
    assert proc.returncode != 0, output(tmp_path / "out")["a"]["cls"]
    assert "row 3" in proc.stderr or "key 'c'" in proc.stderr


def test_manifest_listing_a_file_twice_gives_unique_keys_or_an_error(tmp_path):
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(1))
    (tmp_path / "b.jpg").write_bytes(jpeg_bytes(2))
    src = rows(tmp_path / "m.csv", ["path,label", "a.jpg,0", "b.jpg,1", "a.jpg,0"])
    proc = make("manifest", src, tmp_path / "out")
    if proc.returncode != 0:
        assert "a.jpg" in proc.stderr and "row 3" in proc.stderr
        return
    checked = run_tool("verify_shards", tmp_path / "out", "--jobs", 1)
    assert checked.returncode == 0, checked.stdout
    assert len(output(tmp_path / "out")) == 3


def test_verify_flags_bad_labels_and_missing_fields(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    writer = ShardWriter(out, "train", max_count=100, max_size=10**8)
    for sample in ({"__key__": "ok", "jpg": jpeg_bytes(1), "cls": b"1"},
                   {"__key__": "notint", "jpg": jpeg_bytes(2), "cls": b"cat"},
                   {"__key__": "range", "jpg": jpeg_bytes(3), "cls": b"7"},
                   {"__key__": "negative", "jpg": jpeg_bytes(4), "cls": b"-1"},
                   {"__key__": "noimage", "cls": b"0"},
                   {"__key__": "nolabel", "jpg": jpeg_bytes(5)}):
        writer.write(sample)
    info = writer.finish()
    assert info is not None
    Manifest([info], "image", {"cat": 0, "dog": 1}).save(out / "manifest.json")
    proc = run_tool("verify_shards", out, "--jobs", 1)
    assert proc.returncode == 1
    shard = str(out / "train-000000.tar")
    for key, reason in (("notint", "bad-label"), ("range", "label-out-of-range"),
                        ("negative", "label-out-of-range"), ("noimage", "missing-field"),
                        ("nolabel", "missing-field")):
        assert any(line.strip().startswith(f"{shard} key {key!r}:") and f"[{reason}]" in line
                   for line in proc.stdout.splitlines()), (key, proc.stdout)
    assert "key 'ok'" not in proc.stdout
    assert "problems by reason: bad-label=1, label-out-of-range=2, missing-field=2" in proc.stdout


# == text ======================================================================================

TEXTS = {  # file -> (bytes, reason or None)
    "good.txt": (b"a good document\n", None),
    "utf8.txt": (b"caf\xe9 latin-1, not UTF-8", "bad-utf8"),
    "nul.txt": (b"nul\x00byte", "nul-byte"),
    "empty.txt": (b"", "empty-text"),
    "blank.txt": (b"  \n\t \n", "empty-text"),
    "huge.txt": (b"word " * 400, "text-too-large"),  # 2000 bytes > --max-text-bytes 1KB
}
JSONL = [  # line -> reason or None
    ('{"text": "first line"}', None),
    ("this line is not JSON", "bad-json"),
    ('{"body": "no text field"}', "missing-field"),
    ('{"text": 42}', "missing-field"),
    ('{"text": "last line"}', None),
]


def text_source(root: Path, names: list[str], jsonl: bool) -> Path:
    root.mkdir(parents=True)
    for name in names:
        (root / name).write_bytes(TEXTS[name][0])
    if jsonl:
        rows(root / "docs.jsonl", [line for line, _ in JSONL[:2]] + [""]
             + [line for line, _ in JSONL[2:]])  # a blank line separates, it is not an input
    return root


def test_text_skip_each_bad_document(tmp_path):
    src = text_source(tmp_path / "src", list(TEXTS), jsonl=True)
    out = tmp_path / "out"
    proc = make("text", src, out, "--on-error", "skip", "--max-text-bytes", "1KB")
    assert proc.returncode == 0, proc.stderr
    skip_report(out, len(TEXTS) + len(JSONL), proc.stdout)
    entries = load_manifest(out)["skipped"]
    files = {Path(e["source"]).name: (e["key"], e["reason"]) for e in entries
             if "docs.jsonl" not in e["source"]}
    assert files == {n: (n.split(".")[0], r) for n, (_, r) in TEXTS.items() if r}
    refs = line_refs(src / "docs.jsonl")
    lines = [e for e in entries if "docs.jsonl" in e["source"]]
    bad_lines = {2: "bad-json", 4: "missing-field", 5: "missing-field"}  # line 3 is blank
    assert sorted((n, e["reason"]) for e in lines for n, ref in refs.items()
                  if e["source"] in ref) == sorted(bad_lines.items())
    assert all(e["key"].startswith("docs-") for e in lines)
    texts = sorted(s["txt"] for s in output(out).values())
    assert texts == [b"a good document\n", b"first line", b"last line"]


@pytest.mark.parametrize("bad", [n for n, (_, r) in TEXTS.items() if r] + ["docs.jsonl"])
def test_text_raise_names_file_key_reason(tmp_path, bad):
    jsonl = bad == "docs.jsonl"
    src = text_source(tmp_path / "src", ["good.txt"] + ([] if jsonl else [bad]), jsonl=jsonl)
    err = expect_raise("text", src, tmp_path / "out", limits=CheckLimits(max_text_bytes=1000))
    if jsonl:
        assert err.source in line_refs(src / bad)[2] and err.key.startswith("docs-")
        assert_names(err, err.source, err.key, "bad-json")
    else:
        assert_names(err, str(src / bad), bad.split(".")[0], TEXTS[bad][1])


def test_text_raise_cli_names_line(tmp_path):
    src = text_source(tmp_path / "src", ["good.txt"], jsonl=True)
    proc = make("text", src / "docs.jsonl", tmp_path / "out")
    assert proc.returncode == 1
    assert any(f"{ref} key 'docs-" in proc.stderr for ref in line_refs(src / "docs.jsonl")[2])
    assert "[bad-json]" in proc.stderr


def test_jsonl_lone_surrogate_is_a_bad_input(tmp_path):
    src = rows(tmp_path / "s.jsonl", ['{"text": "\\ud800 lone surrogate"}', '{"text": "ok"}'])
    proc = make("text", src, tmp_path / "out", "--on-error", "skip")
    assert proc.returncode == 0, proc.stderr
    skip_report(tmp_path / "out", 2, proc.stdout)
    [entry] = load_manifest(tmp_path / "out")["skipped"]
    assert entry["source"] in line_refs(src)[1]


# == point clouds ==============================================================================

def _cloud(seed: int, n: int = 20, c: int = 3, dtype: object = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, c)).astype(dtype)


def _with(arr: np.ndarray, row: int, col: int, value: float) -> np.ndarray:
    arr[row, col] = value
    return arr


CLOUDS = {  # name -> (array builder, reason or None); run with --max-points 100
    "ok.npy": (lambda m: _cloud(0), None),
    "wide.npy": (lambda m: _cloud(1, 30, 6, np.float64), None),
    "nan.npy": (lambda m: _with(_cloud(2), 3, 1, np.nan), "non-finite"),
    "inf.npy": (lambda m: _with(_cloud(3), 5, 0, -np.inf), "non-finite"),
    "zero.npy": (lambda m: np.zeros((0, 3), np.float32), "empty"),
    "single.npy": (lambda m: np.ones((1, 3), np.float32), "degenerate"),
    "same.npy": (lambda m: np.full((50, 3), 2.5, np.float32), "degenerate"),
    "many.npy": (lambda m: _cloud(4, 101), "too-many-points"),
    "objects.npy": (lambda m: np.array([[Payload(m), 1.0, 2.0]], dtype=object), "object-dtype"),
    "flat.npy": (lambda m: _cloud(5, 20, 2), "bad-shape"),
}


def cloud_source(root: Path, names: list[str], marker: Path) -> Path:
    for name in names:
        folder = root / ("bad" if CLOUDS[name][1] else "good")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(npy_bytes(CLOUDS[name][0](marker)))
    return root


def test_pointcloud_skip_each_bad_cloud(tmp_path):
    marker = tmp_path / "marker"
    src = cloud_source(tmp_path / "src", list(CLOUDS), marker)
    out = tmp_path / "out"
    proc = make("pointcloud", src, out, "--on-error", "skip", "--max-points", 100)
    assert proc.returncode == 0, proc.stderr
    skipped = skip_report(out, len(CLOUDS), proc.stdout)
    assert skipped == {n: (f"bad_{n[:-4]}", r) for n, (_, r) in CLOUDS.items() if r}
    samples = output(out)
    assert set(samples) == {"good_ok", "good_wide"}
    wide = np.load(io.BytesIO(samples["good_wide"]["npy"]), allow_pickle=False)
    assert wide.dtype == np.float32 and wide.shape == (30, 6)
    assert np.allclose(wide, _cloud(1, 30, 6, np.float64), atol=1e-6)
    assert not marker.exists()


@pytest.mark.parametrize("bad", [n for n, (_, r) in CLOUDS.items() if r])
def test_pointcloud_raise_names_file_key_reason(tmp_path, bad):
    marker = tmp_path / "marker"
    src = cloud_source(tmp_path / "src", ["ok.npy", bad], marker)
    err = expect_raise("pointcloud", src, tmp_path / "out", limits=CheckLimits(max_points=100))
    assert_names(err, str(src / "bad" / bad), f"bad_{bad[:-4]}", CLOUDS[bad][1])
    assert not marker.exists()


# == configuration and URLs ====================================================================

def good_shards(folder: Path, count: int = 2) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(folder, "old", max_count=2, max_size=10**8)
    for i in range(2 * count):
        if not writer.fits({"__key__": f"k{i}", "txt": b"x"}):
            writer.finish()
        writer.write({"__key__": f"k{i}", "txt": f"doc {i}".encode()})
    writer.finish()
    return sorted(folder.glob("*.tar"))


def test_out_with_shards_refused_unless_overwrite(tmp_path):
    src = good_shards(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "data-000000.tar").write_bytes(b"precious")
    refused = make("shards", tmp_path / "src", out)
    assert refused.returncode == 2
    assert "data-000000.tar" in refused.stderr and "--overwrite" in refused.stderr
    assert (out / "data-000000.tar").read_bytes() == b"precious"
    done = make("shards", tmp_path / "src", out, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert not (out / "data-000000.tar").exists() and len(output(out)) == 2 * len(src)


def test_overwrite_in_place_never_deletes_the_source(tmp_path):
    folder = tmp_path / "shards"
    originals = {p.name: p.read_bytes() for p in good_shards(folder)}
    make("shards", folder, folder, "--overwrite")
    keys = set()
    for path in folder.glob("*.tar"):
        with open(path, "rb") as f:
            keys |= {s["__key__"] for s in iter_samples(f, path.name)}
    assert keys >= {"k0", "k1", "k2", "k3"}, (sorted(originals), sorted(keys))


@pytest.mark.parametrize("tool", ["make_shards", "verify_shards"])
def test_pipe_url_refused_without_running_it(tmp_path, tool):
    marker = tmp_path / "ran"
    url = f"pipe:touch {marker}"
    args = ("shards", url, tmp_path / "out") if tool == "make_shards" else (url,)
    proc = run_tool(tool, *args)
    assert proc.returncode == 2 and "pipe:" in proc.stderr and "refusing" in proc.stderr
    assert not marker.exists()


def test_pipe_url_refusal_does_not_echo_credentials(tmp_path):
    proc = make("shards", "pipe:curl -s http://alice:secret@127.0.0.1:1/a.tar", tmp_path / "o")
    assert proc.returncode == 2 and "refusing" in proc.stderr
    assert "secret" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("url", [
    "http://alice:secret@127.0.0.1:1/train-000000.tar",
    "ftp://alice:secret@127.0.0.1:1/train-000000.tar",
    "http://127.0.0.1:1/train-000000.tar?X-Amz-Signature=secret&part=1",
])
def test_url_credentials_fail_fast_and_are_never_echoed(tmp_path, url):
    out = tmp_path / "out"
    (made, made_out), (checked, checked_out) = run_bounded([
        tool_cmd("make_shards", "shards", url, out, "--workers", 1, "--quiet"),
        tool_cmd("verify_shards", url, "--jobs", 1)], timeout=30)
    assert made not in (0, None) and checked not in (0, None)  # nothing listens on port 1
    assert "secret" not in made_out + checked_out
    assert not any("secret" in p.read_text(errors="replace") for p in out.rglob("*")
                   if p.is_file())


def test_credentials_redacted_in_manifest_skips_and_logs(tmp_path, caplog):
    import fsspec

    url = f"memory://alice:secret@bucket-{tmp_path.name}/train-000000.tar"
    with fsspec.open(url, "wb") as f:
        f.write(tar_bytes([("r-a.txt", b"fine"), ("r-b.txt", b"x"), ("r-b.pkl", b"junk")]))
    try:
        m = in_process("shards", url, tmp_path / "out", on_error="skip")
        reports, _ = verify(url)
    finally:
        fsspec.filesystem("memory").rm(url)
    assert m.total_samples == 1 and [e["reason"] for e in m.skipped] == ["pickle-member"]
    assert m.skipped[0]["source"].startswith("memory://***@bucket-")
    assert "secret" not in (tmp_path / "out" / "manifest.json").read_text()
    assert "secret" not in reports[0].url + json.dumps(reports[0].problems)
    assert "secret" not in caplog.text and "pickle-member" in caplog.text


# == verify_shards on folders that changed after writing =======================================

def test_verify_clean_then_tampered_shards_and_indexes(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=1, per_class=4)
    out = tmp_path / "out"
    made = make("imagefolder", src, out, "--max-count", 1)
    assert made.returncode == 0, made.stderr
    clean = run_tool("verify_shards", out, "--jobs", 1)
    assert clean.returncode == 0 and "all shards verified: no problems" in clean.stdout
    shard0 = out / "train-000000.tar"
    data = bytearray(shard0.read_bytes())
    data[-1] ^= 0xFF  # in the end-of-archive padding: only the checksum can tell
    shard0.write_bytes(bytes(data))
    (out / "train-000001.idx").unlink()
    idx = (out / "train-000002.idx").read_text().splitlines()
    fields = idx[1].split()
    fields[1] = str(int(fields[1]) + 512)  # first member's offset moved by one block
    (out / "train-000002.idx").write_text("\n".join([idx[0], " ".join(fields), *idx[2:]]) + "\n")
    (out / "train-000003.tar").unlink()
    proc = run_tool("verify_shards", out, "--jobs", 1)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    for where, reason in (("train-000000.tar", "sha256-mismatch"),
                          ("train-000001.tar", "missing-index"),
                          ("train-000002.idx", "bad-index"),
                          ("train-000003.tar", "missing-shard")):
        assert any(line.strip().startswith(f"{out / where}:") and f"[{reason}]" in line
                   for line in lines), (where, proc.stdout)
    assert ("problems by reason: bad-index=1, missing-index=1, missing-shard=1, "
            "sha256-mismatch=1") in proc.stdout


# == extra cases a careful user would try ======================================================

def test_imagefolder_symlinked_image_is_not_dropped_silently(tmp_path):
    store = make_image_folder(tmp_path / "store", classes=1, per_class=2)
    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "linked.jpg").symlink_to(store / "class0" / "img000.jpg")
    (tmp_path / "src" / "cat" / "copied.jpg").write_bytes(
        (store / "class0" / "img001.jpg").read_bytes())
    proc = make("imagefolder", tmp_path / "src", tmp_path / "out", "--on-error", "skip")
    assert proc.returncode == 0, proc.stderr
    m = load_manifest(tmp_path / "out")
    named = {Path(e["source"]).name for e in m["skipped"] + m["ignored"]}
    assert "cat_linked" in output(tmp_path / "out") or "linked.jpg" in named


@pytest.mark.parametrize("kind, option", [
    ("imagefolder", "--max-pixels"), ("text", "--max-text-bytes"), ("pointcloud", "--max-points"),
    ("shards", "--max-member-size")])
def test_zero_limits_are_refused_naming_the_option(tmp_path, kind, option):
    proc = make(kind, tmp_path, tmp_path / "out", option, 0)
    assert proc.returncode == 2 and f"argument {option}" in proc.stderr
    assert "unrecognized" not in proc.stderr and not (tmp_path / "out").exists()


# == FIFOs and devices where files are expected =================================================

def test_fifos_and_devices_are_refused_never_opened(tmp_path):
    """Opening a FIFO blocks until a writer comes (maybe never); /dev/zero never ends."""
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    (src / "c" / "ok.jpg").write_bytes(jpeg_bytes(1))
    os.mkfifo(src / "c" / "pipe.jpg")
    (src / "c" / "zero.jpg").symlink_to("/dev/zero")
    listing = rows(src / "list.csv", ["path,label", "c/ok.jpg,0", "c/pipe.jpg,1",
                                      "c/zero.jpg,1"])  # a listed link is followed
    shards = good_shards(tmp_path / "shards")
    os.mkfifo(tmp_path / "shards" / "old-000009.tar")
    (tmp_path / "shards" / "old-000001.idx").unlink()
    os.mkfifo(tmp_path / "shards" / "old-000001.idx")  # where an index belongs
    (raised, out_raise), (skipped, out_skip), (folder, _), (checked, out_verify) = run_bounded([
        tool_cmd("make_shards", "manifest", listing, tmp_path / "o1", "--workers", 1),
        tool_cmd("make_shards", "manifest", listing, tmp_path / "o2", "--workers", 1,
                 "--on-error", "skip"),
        tool_cmd("make_shards", "imagefolder", src, tmp_path / "o3", "--workers", 1),
        tool_cmd("verify_shards", f"{tmp_path / 'shards'}/*.tar", "--jobs", 1)], timeout=120)
    assert raised == 1 and "pipe.jpg key 'pipe'" in out_raise
    assert "[not-a-regular-file]" in out_raise
    assert skipped == 0, out_skip
    reasons = {Path(e["source"]).name: e["reason"] for e in load_manifest(tmp_path / "o2")
               ["skipped"]}
    assert reasons == {"pipe.jpg": "not-a-regular-file", "zero.jpg": "not-a-regular-file"}
    assert folder == 0 and load_manifest(tmp_path / "o3")["total_samples"] == 1
    ignored = {Path(e["source"]).name: e["reason"] for e in load_manifest(tmp_path / "o3")
               ["ignored"]}
    assert ignored == {"pipe.jpg": "not-a-regular-file", "zero.jpg": "symlink",
                       "list.csv": "not-a-class-image"}
    assert checked == 1 and "old-000009.tar: the path is a FIFO" in out_verify
    assert "old-000001.idx: the path is a FIFO" in out_verify and "bad-index" in out_verify
    assert len(shards) == 2
