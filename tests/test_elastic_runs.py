"""Elastic resume under torchrun with gloo: `tools/train.py` killed (SIGKILL) on N ranks and
resumed from its checkpoint on M, for images and packed text, 2 -> 1 and 1 -> 2. The first
epoch is trained on exactly once across both runs: no sample twice, none lost but those the
even split of the rest over the new ranks leaves out, which the run reports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import ROOT, run_tool
from test_kills import _kill_after, _records

from shardflow.builtin import make_image_folder, make_text_corpus

# Past the first epoch in every case: image 9 shards of 20 (8 train): 160 samples, 20 batches
# of 8 on one rank; text 8 shards of 4 documents (7 train): about 15 k tokens, 15 batches of
# 16 x 64 tokens on one rank.
STEPS = {"image": 26, "text": 22}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("elastic-runs")
    images = make_image_folder(root / "img", per_class=18, size=16)
    run_tool("make_shards", "imagefolder", images, root / "img-shards", "--max-count", 20,
             "--shuffle-seed", 0, check=True)
    docs = make_text_corpus(root / "docs", docs=30)
    run_tool("make_shards", "text", docs, root / "text-shards", "--max-count", 4, check=True)
    return {"image": root / "img-shards", "text": root / "text-shards"}


def _command(task: str, shards: Path, out: Path, world: int) -> list[str]:
    size = ["--size", "16", "--batch-size", "8"] if task == "image" else \
        ["--seq-len", "64", "--batch-size", "16"]
    train = [str(ROOT / "tools" / "train.py"), "--task", task, "--data", str(shards),
             "--out", str(out), "--steps", str(STEPS[task]), *size,
             "--checkpoint-every", "1", "--log-keys", "--device", "cpu", "--precision",
             "fp32"]
    if world == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world}", *train]


def _train_keys(shards: Path) -> set[str]:
    """Keys of the shards train.py trains on: all but the held-out last (every 10th, at
    least one, by name)."""
    names = sorted(p for p in shards.glob("*.tar"))[:-1]
    keys = set()
    for path in names:
        with tarfile.open(path) as tar:
            keys |= {m.name.split(".", 1)[0] for m in tar.getmembers()}
    return keys


@pytest.mark.slow
@pytest.mark.parametrize("task,before,after", [("image", 2, 1), ("image", 1, 2),
                                               ("text", 2, 1), ("text", 1, 2)])
def test_killed_on_n_ranks_resumed_on_m(data, tmp_path, task, before, after):
    out = tmp_path / "run"
    _kill_after(_command(task, data[task], out, before), out, 6 * before)
    assert not (out / "summary.json").exists(), "the run finished before it was killed"
    killed = _records(out)
    done = subprocess.run(_command(task, data[task], out, after), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    resumed = summary["resumed_at_step"]
    assert summary["steps"] == STEPS[task] and resumed >= 1
    # Batches the killed run took after its last checkpoint were rolled back with it.
    records = [r for r in killed if r["step"] < resumed] + _records(out)[len(killed):]
    epoch0 = [k for r in records if r["epoch"] == 0 for k in r["keys"]]
    found = re.findall(r"epoch 0: each of \d+ ranks reads \d+ samples; (\d+) samples are "
                       r"left out", done.stderr)
    left_out = int(found[0]) if found else 0
    missing = _train_keys(data[task]) - set(epoch0)
    assert set(epoch0) <= _train_keys(data[task])
    if task == "image":
        assert len(epoch0) == len(set(epoch0)), "a sample trained on twice"
        assert len(missing) == left_out, "samples lost without a report"
        return
    # A document cut between two batches is named by both; nothing else twice.
    batches = sum(1 for r in records if r["epoch"] == 0)
    assert len(epoch0) - len(set(epoch0)) < batches
    if after == 1:
        assert not missing
        return
    # Packed ranks also stop together when the first runs out of tokens: the longer rank
    # leaves the rest of its share out, and says so. Every loss must be reported, and can be
    # no more than what was left out to even the ranks plus one rank's share of the epoch.
    cut_short = re.search(r"epoch 0: rank \d+ stops after \d+ batches, where the shortest "
                          r"rank ran out", done.stderr)
    if missing:
        assert found or cut_short, f"{len(missing)} documents lost without a report"
    assert len(missing) <= left_out + (len(_train_keys(data[task])) // after if cut_short
                                       else 0), (len(missing), left_out, bool(cut_short))
    assert {r["rank"] for r in _records(out)[len(killed):] if r["epoch"] == 0} == {0, 1}
