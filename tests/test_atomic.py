"""make_shards under faults: killed mid-run, or out of disk space. No partial file ever has
a final name, and running the same command again finishes the job with the same bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, load_manifest, run_tool

from shardflow.builtin import make_image_folder

ARGS = ["--max-count", "8", "--workers", "1", "--quiet"]


def _assert_only_whole_shards(out: Path, ref: Path) -> None:
    """Every file under a final name is whole: byte for byte the file an uninterrupted run
    writes under that name (a kill may land after a rename and before the journal records
    it; the rerun then writes that shard again)."""
    for path in list(out.glob("*.tar")) + list(out.glob("*.idx")):
        assert path.read_bytes() == (ref / path.name).read_bytes(), f"{path.name} is partial"


def _wait_for_shards(out: Path, proc: subprocess.Popen, count: int) -> None:
    record = out / ".make_shards.journal.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if len(json.loads(record.read_text())["shards"]) >= count:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.01)  # polling a real process; not a timing assertion
    raise AssertionError("the conversion finished or stalled before it could be killed")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A source and the reference output of one uninterrupted conversion."""
    root = tmp_path_factory.mktemp("atomic")
    src = make_image_folder(root / "src", per_class=24, size=48)
    run_tool("make_shards", "imagefolder", src, root / "ref", *ARGS, check=True)
    return src, root / "ref"


def test_killed_conversion_leaves_no_partial_file_and_rerun_finishes(source, tmp_path):
    src, ref = source
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "tools" / "make_shards.py"), "imagefolder", str(src),
           str(out), *ARGS]
    for kill_after in (2, 9):  # kill twice at different points, resuming in between
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_shards(out, proc, kill_after)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (out / "manifest.json").exists()
        _assert_only_whole_shards(out, ref)
    run_tool("make_shards", "imagefolder", src, out, *ARGS, check=True)
    assert not list(out.glob(".*"))  # no temporary files or journal left behind
    assert load_manifest(out)["shards"] == load_manifest(ref)["shards"]
    for tar in sorted(ref.glob("*.[ti][ad][rx]")):
        assert (out / tar.name).read_bytes() == tar.read_bytes()


def test_rerun_with_other_arguments_is_refused(source, tmp_path):
    src, _ = source
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "make_shards.py"),
                             "imagefolder", str(src), str(out), *ARGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_shards(out, proc, 1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    other = run_tool("make_shards", "imagefolder", src, out, "--max-count", "5", "--quiet")
    assert other.returncode != 0 and "unfinished conversion" in other.stderr


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 400 KB tmpfs: needs root and permission to mount; skipped otherwise."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_leaves_no_partial_file_and_rerun_with_space_finishes(source, tiny_disk):
    src, ref = source
    out = tiny_disk / "out"
    full = run_tool("make_shards", "imagefolder", src, out, *ARGS)
    assert full.returncode == 3, full.stderr
    assert "No space left" in full.stderr and "rerun the same command" in full.stderr
    assert not (out / "manifest.json").exists()
    _assert_only_whole_shards(out, ref)
    assert not list(out.glob(".*.tmp"))
    subprocess.run(["mount", "-o", "remount,size=20m", str(tiny_disk)], check=True)
    run_tool("make_shards", "imagefolder", src, out, *ARGS, check=True)
    assert load_manifest(out)["shards"] == load_manifest(ref)["shards"]
