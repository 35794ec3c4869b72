"""SIGKILL at random steps, with a checkpoint written at every step (so kills land inside
writes too), resumed each time: every sample of the first epoch is trained on exactly once,
on two gloo ranks under torchrun, through both readers. (One rank is test_trainers.py's kill
test: DALI's reader in make test's first pass, the stream reader in its second.)"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, process_tree, run_tool

from shardflow.builtin import make_image_folder

STEPS = 30  # past the first epoch (12 batches per rank)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kills")
    src = make_image_folder(root / "src", per_class=27, size=24)
    run_tool("make_shards", "imagefolder", src, root / "shards", "--max-count", 27,
             "--shuffle-seed", 0, check=True)
    return root / "shards"


def _command(shards: Path, out: Path, world: int, reader: str) -> list[str]:
    train = [str(ROOT / "tools" / "train.py"), "--task", "image", "--data", str(shards),
             "--out", str(out), "--steps", str(STEPS), "--batch-size", "9", "--size", "16",
             "--reader", reader, "--checkpoint-every", "1", "--log-keys", "--quiet",
             "--device", "cpu", "--precision", "fp32"]
    if world == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world}", *train]


def _records(out: Path) -> list[dict]:
    path = out / "keys.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # only a line torn by the kill
            assert line is lines[-1], "a torn line in the middle of keys.jsonl"
    return records


def _kill_after(cmd: list[str], out: Path, records: int) -> None:
    """Start the run; SIGKILL it and every process it started once keys.jsonl has `records`
    lines."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if len(_records(out)) >= records:
                break
            try:
                proc.wait(timeout=0.01)  # poll the real process; no timing is asserted
            except subprocess.TimeoutExpired:
                pass
    finally:
        for pid in process_tree(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("world,reader", [(2, "dali"), (2, "stream")])
def test_killed_at_random_steps_each_sample_is_seen_once(shards, tmp_path, world, reader):
    out = tmp_path / "run"
    cmd = _command(shards, out, world, reader)
    rng = random.Random(f"{world}/{reader}")
    for target in sorted(rng.sample(range(3 * world, (STEPS - 4) * world), 2)):
        _kill_after(cmd, out, len(_records(out)) + target // 2)
        assert not (out / "summary.json").exists(), "the run finished before it was killed"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["resumed_at_step"] >= 1
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp")), "a partial file stayed"
    last: dict[tuple[int, int], dict] = {}  # a step re-run after a resume replaces its record
    for record in _records(out):
        last[(record["rank"], record["step"])] = record
    assert {step for _, step in last} == set(range(STEPS))
    epoch0 = [k for r in last.values() if r["epoch"] == 0 for k in r["keys"]]
    # 9 training shards of 27 (the 10th is held out); two ranks read 5 and 4 shards, evened
    # out to 108 samples each
    assert len(epoch0) == len(set(epoch0)) == 216
