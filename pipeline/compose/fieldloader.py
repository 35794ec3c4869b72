"""The loader of a pipeline without an image: every field decoded in the reader stage's thread.

    shards -> reader (DALI's for local indexed shards, else streaming; the first field's member
      is the one a sample must have to be read, the others ride along)
      -> per sample: each field decoded, the map/filter steps (samples.SampleStage)
      -> per batch: each field's encode (the tokenizer's batch call)
      -> the consumer: collate (tensors where the values stack), to the device

It is a Loader like the others (epochs, exact and elastic resume, skips, subsets, holdout):
its position is the reader's after each batch, as the image loader's is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardflow.compose.samples import SampleStage
from shardflow.errors import DataError
from shardflow.loading.batch import EncodedBatch
from shardflow.loading.loader import Loader, Produced
from shardflow.loading.options import LoaderOptions
from shardflow.loading.readplan import EpochPlan
from shardflow.loading.shardlist import Source


@dataclass
class FieldsBatch:
    """What the reader stage hands over: the samples' keys and each member's values."""

    keys: list[str]
    extras: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.keys)


class FieldLoader(Loader):
    """Batches of decoded fields (no image); the pipeline's loader hands them out."""

    kind = "samples"

    def __init__(self, source: Source, cfg: LoaderOptions, stage: SampleStage,
                 primary: str, rank: int, world_size: int) -> None:
        self.cfg, self.stage, self.primary = cfg, stage, primary
        self._init_from_config(source, cfg, rank, world_size)

    def describe(self) -> dict[str, Any]:
        return {"backend": "none (no image)", "reader": self.reader, "decode": "cpu",
                "device": self.device, "augment": []}

    def _produce(self, plan: EpochPlan, reader_state: dict[str, Any] | None,
                 stop: threading.Event) -> Iterator[Produced]:
        others = tuple(m for m in self.stage.members if m != self.primary)
        for enc in self._encoded(plan, reader_state, (self.primary,), others):
            if stop.is_set():
                return
            enc.extras[self.primary] = [None] * len(enc)  # filled from `data` by each check
            self._check_each(enc, lambda e, i: self._check_one(e, i, plan.epoch))
            self.stage.encode(enc)
            yield FieldsBatch(list(enc.keys), enc.extras), enc.state, None, enc.skips

    def _check_one(self, enc: EncodedBatch, i: int, epoch: int) -> None:
        if not len(enc.data[i]):
            raise DataError("missing-field", f"no .{self.primary} member")
        enc.extras[self.primary][i] = enc.data[i].tobytes()
        self.stage.check(enc, i, epoch, None)
