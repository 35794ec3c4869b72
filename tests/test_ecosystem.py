"""shardflow's loaders in the training frameworks users bring: Lightning (a loader as
train_dataloader and val_dataloader, killed mid-epoch and resumed from Lightning's own
checkpoint) and Accelerate (the README's loop). Both are in the dev extra; each test skips
where its package does not import."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, import_or_skip

from shardflow import image_loader
from shardflow.builtin import make_image_folder
from shardflow.convert import ConvertConfig, convert

BATCH, SAMPLES = 8, 40


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 images in 10 classes, 5 shards of 8."""
    root = tmp_path_factory.mktemp("ecoshards")
    src = make_image_folder(root / "src", per_class=4, size=24)
    convert(ConvertConfig(kind="imagefolder", src=str(src), out=root / "out", max_count=8,
                          workers=1))
    return root / "out"


def _lightning(shards: Path, run: Path, devices: int, max_steps: int, *flags: object
               ) -> subprocess.CompletedProcess:
    """tests/lightning_run.py in a child process: Lightning's fit of a linear model for 2
    epochs, a checkpoint after every step, resumed from RUN/last.ckpt when there is one."""
    script = [sys.executable, str(Path(__file__).parent / "lightning_run.py"), str(shards),
              str(run), str(devices), str(max_steps), *map(str, flags)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(script, env=env, timeout=300, capture_output=True, text=True)


def _seen(run: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line)
            for line in (run / f"keys-{rank}.jsonl").read_text().splitlines()]


def test_lightning_resumes_mid_epoch_with_exactly_the_remaining_samples(shards, tmp_path):
    """The process is SIGKILLed at the start of global step 7 (5 steps an epoch: 2 into epoch
    1), not an exception Lightning could unwind; the same command again resumes from the
    checkpoint the killed process left."""
    import_or_skip("lightning.pytorch")
    flags = ("--batch", BATCH, "--validate")
    killed = _lightning(shards, tmp_path, 1, -1, *flags, "--kill-at", 7)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    first = _seen(tmp_path)
    # Lightning keeps the loader's own state (state_dict) in its checkpoint, and gives it back
    # through load_state_dict on resume.
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    state = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert (state["kind"], state["epoch"], state["batches"]) == ("image", 1, 2)
    done = _lightning(shards, tmp_path, 1, -1, *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = _seen(tmp_path)
    rest = seen[len(first):]
    train = [(r["epoch"], r["keys"]) for r in seen if r["stage"] == "train"]
    for epoch in (0, 1):
        keys = [k for e, ks in train if e == epoch for k in ks]
        assert len(keys) == SAMPLES and len(set(keys)) == SAMPLES, epoch  # each once
    assert [e for e, _ in train] == [0] * 5 + [1] * 5
    assert sum(r["stage"] == "train" for r in rest) == 3  # only what was left
    # The sanity check's 2 validation batches do not shorten the epoch's validation.
    val = [r["keys"] for r in seen if r["stage"] == "val"]
    assert [len(keys) for keys in val] == [BATCH] * 12
    epochs = [{k for ks in val[2:7] for k in ks}, {k for ks in val[7:] for k in ks}]
    assert len(epochs[0]) == SAMPLES and epochs[0] == epochs[1]


@pytest.mark.slow
def test_lightning_ddp_on_two_ranks_resumes_on_one_with_every_sample_once(shards, tmp_path):
    """Lightning's DDP (gloo, 2 processes) stopped mid-epoch, resumed from its checkpoint on
    one process: the loader's state holds both ranks' positions (gathered when Lightning
    saves on every rank), and the rest of the epoch goes to the one rank (elastic.py)."""
    import_or_skip("lightning.pytorch")
    for devices, max_steps in ((2, 3), (1, -1)):
        done = _lightning(shards, tmp_path, devices, max_steps)
        assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for rank in (0, 1)
               for line in (tmp_path / f"keys-{rank}.jsonl").read_text().splitlines()]
    assert sorted({(r["world"], r["step"]) for r in records if r["world"] == 2}) == \
        [(2, 0), (2, 1), (2, 2)]
    for epoch in (0, 1):
        keys = [k for r in records if r["epoch"] == epoch for k in r["keys"]]
        assert len(keys) == len(set(keys)) == SAMPLES, epoch  # each once, none lost


def test_the_readme_accelerate_loop_trains_on_the_loader(shards):
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    # As in the README: the loader is built for this process's rank and device, and is not
    # passed to prepare() (it is not a DataLoader to shard: it shards by rank itself).
    loader = image_loader(shards, batch_size=BATCH, size=16, seed=1, use_tuning=False,
                          threads=1, train=False, rank=accelerator.process_index,
                          world_size=accelerator.num_processes, device=str(accelerator.device))
    model = torch.nn.Linear(3 * 16 * 16, 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, keys = [], []
    with loader:
        for _ in range(10):
            for batch in loader:
                loss = torch.nn.functional.cross_entropy(
                    model(batch.image.float().flatten(1) / 255), batch.label)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                keys += batch.keys
    assert len(keys) == 10 * SAMPLES and len(set(keys)) == SAMPLES
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])  # it learns
