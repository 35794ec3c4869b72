"""Lightning on the CPU with a shardflow loader, on DEVICES processes (DDP over gloo when more
than one): fits 2 epochs, stopping after MAX_STEPS (-1: none), a checkpoint after every step;
run again, it resumes from RUN/last.ckpt. Each rank appends what each step saw to
RUN/keys-RANK.jsonl. Used by tests/test_ecosystem.py; Lightning starts the other ranks by
running this file again.

    python tests/lightning_run.py SHARDS RUN DEVICES MAX_STEPS
"""
import json
import os
import sys

import lightning as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from pipeline import image_loader

shards, run, devices, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


class Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3 * 16 * 16, 10)

    def train_dataloader(self):  # built here: the process group exists, rank and world are its
        self.loader = image_loader(shards, batch_size=4, size=16, device="cpu", threads=1,
                                   use_tuning=False, seed=3)
        return self.loader

    def training_step(self, batch, _):
        with open(os.path.join(run, f"keys-{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.global_step, "epoch": self.current_epoch,
                                "world": self.trainer.world_size, "keys": batch.keys}) + "\n")
        x = batch.image.float().flatten(1) / 255
        return torch.nn.functional.cross_entropy(self.lin(x), batch.label)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


resume = os.path.join(run, "last.ckpt")
trainer = pl.Trainer(max_epochs=2, max_steps=max_steps, accelerator="cpu", devices=devices,
                     strategy="ddp" if devices > 1 else "auto", logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[ModelCheckpoint(dirpath=run, every_n_train_steps=1,
                                                save_last=True)])
trainer.fit(Linear(), ckpt_path=resume if os.path.exists(resume) else None)
