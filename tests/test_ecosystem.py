"""shardflow's loaders in the training frameworks users bring: Lightning (a loader as
train_dataloader and val_dataloader, killed mid-epoch and resumed from Lightning's own
checkpoint) and Accelerate (the README's loop). Both are in the dev extra; each test skips
where its package does not import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from pipeline import image_loader
from pipeline.builtin import make_image_folder
from pipeline.convert import ConvertConfig, convert

BATCH, SAMPLES = 8, 40


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 images in 10 classes, 5 shards of 8."""
    root = tmp_path_factory.mktemp("ecoshards")
    src = make_image_folder(root / "src", per_class=4, size=24)
    convert(ConvertConfig(kind="imagefolder", src=str(src), out=root / "out", max_count=8,
                          workers=1))
    return root / "out"


def _loaders(shards: Path) -> tuple:
    opts = {"batch_size": BATCH, "size": 16, "device": "cpu", "threads": 1, "use_tuning": False}
    return image_loader(shards, seed=3, **opts), image_loader(shards, train=False, **opts)


class _Crash(Exception):
    pass


def _lightning_run(shards: Path, run: Path, crash_at: int | None) -> list:
    """Lightning's fit of a linear model for 2 epochs, a checkpoint after every step; with
    `crash_at`, the step of that global index raises (the process "dies" there); without, it
    resumes from last.ckpt. Returns what each step saw: (stage, epoch, keys)."""
    import lightning as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen: list = []

    class Linear(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3 * 16 * 16, 10)

        def training_step(self, batch, _):  # type: ignore[no-untyped-def]
            if crash_at is not None and self.global_step == crash_at:
                raise _Crash
            seen.append(("train", self.current_epoch, list(batch.keys)))
            x = batch.image.float().flatten(1) / 255
            return torch.nn.functional.cross_entropy(self.lin(x), batch.label)

        def validation_step(self, batch, _):  # type: ignore[no-untyped-def]
            seen.append(("val", self.current_epoch, list(batch.keys)))

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    train, val = _loaders(shards)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=2, callbacks=[ModelCheckpoint(
                             dirpath=run, every_n_train_steps=1, save_last=True,
                             save_top_k=-1)])
    with train, val:
        try:
            trainer.fit(Linear(), train, val,
                        ckpt_path=None if crash_at is not None else str(run / "last.ckpt"))
        except _Crash:
            pass
    return seen


def test_lightning_resumes_mid_epoch_with_exactly_the_remaining_samples(shards, tmp_path):
    pytest.importorskip("lightning")
    first = _lightning_run(shards, tmp_path, crash_at=7)  # 5 steps an epoch: 2 into epoch 1
    # Lightning keeps the loader's own state (state_dict) in its checkpoint, and gives it back
    # through load_state_dict on resume.
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    state = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert (state["kind"], state["epoch"], state["batches"]) == ("image", 1, 2)
    rest = _lightning_run(shards, tmp_path, crash_at=None)
    train = [(epoch, keys) for stage, epoch, keys in first + rest if stage == "train"]
    for epoch in (0, 1):
        keys = [k for e, ks in train if e == epoch for k in ks]
        assert len(keys) == SAMPLES and len(set(keys)) == SAMPLES, epoch  # each once
    assert [e for e, _ in train] == [0] * 5 + [1] * 5
    assert sum(stage == "train" for stage, _, _ in rest) == 3  # only what was left
    # The sanity check's 2 validation batches do not shorten the epoch's validation.
    val = [(epoch, keys) for stage, epoch, keys in first + rest if stage == "val"]
    assert [len(keys) for _, keys in val] == [BATCH] * 12
    whole = {k for e, ks in val[2:7] for k in ks}
    assert len(whole) == SAMPLES and whole == {k for e, ks in val[7:] for k in ks}


@pytest.mark.slow
def test_lightning_ddp_on_two_ranks_resumes_on_one_with_every_sample_once(shards, tmp_path):
    """Lightning's DDP (gloo, 2 processes) stopped mid-epoch, resumed from its checkpoint on
    one process: the loader's state holds both ranks' positions (gathered when Lightning
    saves on every rank), and the rest of the epoch goes to the one rank (elastic.py)."""
    pytest.importorskip("lightning")
    script = [sys.executable, str(Path(__file__).parent / "lightning_run.py"), str(shards),
              str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for devices, max_steps in ((2, 3), (1, -1)):
        done = subprocess.run([*script, str(devices), str(max_steps)], env=env, timeout=300,
                              capture_output=True, text=True)
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
