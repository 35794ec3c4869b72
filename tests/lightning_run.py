"""Lightning on the CPU with a shardflow loader, on DEVICES processes (DDP over gloo when more
than one): fits 2 epochs, stopping after MAX_STEPS (-1: none), a checkpoint after every step;
run again, it resumes from RUN/last.ckpt. Each rank appends what each step saw to
RUN/keys-RANK.jsonl, one line a step, flushed before the step trains. Used by
tests/test_ecosystem.py; Lightning starts the other ranks by running this file again.

    python tests/lightning_run.py SHARDS RUN DEVICES MAX_STEPS [--batch B] [--validate]
                                  [--kill-at STEP]

--validate adds a validation loader (2 sanity batches first); --kill-at SIGKILLs the process
at the start of that global step, a real death: nothing of Lightning's is unwound, the
checkpoint on disk is the one the previous step left.
"""
import argparse
import json
import os
import signal

import lightning as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from shardflow import image_loader

parser = argparse.ArgumentParser()
parser.add_argument("shards")
parser.add_argument("run")
parser.add_argument("devices", type=int)
parser.add_argument("max_steps", type=int)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--validate", action="store_true")
parser.add_argument("--kill-at", type=int, default=None)
args = parser.parse_args()
OPTS = {"batch_size": args.batch, "size": 16, "device": "cpu", "threads": 1,
        "use_tuning": False}


class Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3 * 16 * 16, 10)

    def train_dataloader(self):  # built here: the process group exists, rank and world are its
        self.loader = image_loader(args.shards, seed=3, **OPTS)
        return self.loader

    if args.validate:
        def val_dataloader(self):
            return image_loader(args.shards, train=False, **OPTS)

    def _record(self, stage: str, keys: list) -> None:
        with open(os.path.join(args.run, f"keys-{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"stage": stage, "step": self.global_step,
                                "epoch": self.current_epoch,
                                "world": self.trainer.world_size, "keys": keys}) + "\n")

    def training_step(self, batch, _):
        if self.global_step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self._record("train", batch.keys)
        x = batch.image.float().flatten(1) / 255
        return torch.nn.functional.cross_entropy(self.lin(x), batch.label)

    def validation_step(self, batch, _):
        self._record("val", batch.keys)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


resume = os.path.join(args.run, "last.ckpt")
trainer = pl.Trainer(max_epochs=2, max_steps=args.max_steps, accelerator="cpu",
                     devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=2 if args.validate else 0,
                     callbacks=[ModelCheckpoint(dirpath=args.run, every_n_train_steps=1,
                                                save_last=True)])
trainer.fit(Linear(), ckpt_path=resume if os.path.exists(resume) else None)
