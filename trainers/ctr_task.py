"""Click-through-rate prediction: DLRM or DeepFM (ctr_models.py) over
`TabularBatch(dense, sparse, label, keys)`, binary cross-entropy on the logits, and the
held-out set's AUC and logloss (ctr_metrics.py).

    task = ClickThroughRate("dlrm", num_dense=13, num_buckets=loader.schema.num_buckets,
                            device="cuda", embeddings_on_cpu=True)

The loss is computed in float32 from the logits (`binary_cross_entropy_with_logits`, stable
for any logit) whatever the autocast precision of the network. Evaluation keeps every
held-out row's logit on the host: `eval_loss` and `logloss` (the same number: mean nats per
row) and `auc` reach summary.json, eval.jsonl and the curves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardflow.trainers.ctr_metrics import ScoredTotals
from shardflow.trainers.ctr_models import build_ctr_model
from shardflow.trainers.task import StepOutput


class ClickThroughRate:
    """The Task for tabular click logs; `num_buckets`: one table size per categorical field,
    as the loader hashes them (its `schema.num_buckets`)."""

    def __init__(self, model: str, num_dense: int, num_buckets: Sequence[int],
                 device: torch.device | str = "cpu", embedding_dim: int = 16,
                 embeddings_on_cpu: bool = False) -> None:
        self.model_name, self.num_dense = model, num_dense
        self.num_buckets, self.embedding_dim = [int(n) for n in num_buckets], embedding_dim
        self.device = torch.device(device)
        self.embeddings_on_cpu = embeddings_on_cpu and self.device.type != "cpu"
        net = build_ctr_model(model, num_dense, self.num_buckets, embedding_dim)
        self.model: torch.nn.Module = net.place(self.device, self.embeddings_on_cpu)

    def _logits(self, batch: Any) -> torch.Tensor:
        dense, sparse = batch.dense, batch.sparse
        if dense.shape[1] != self.num_dense or sparse.shape[1] != len(self.num_buckets):
            raise ValueError(f"a batch of {dense.shape[1]} dense and {sparse.shape[1]} "
                             f"categorical fields for a model built for {self.num_dense} and "
                             f"{len(self.num_buckets)}: train and evaluate on data of one "
                             "schema (the same --preset or columns)")
        return self.model(dense, sparse).float()

    def forward(self, batch: Any) -> StepOutput:
        logits = self._logits(batch)
        return StepOutput(F.binary_cross_entropy_with_logits(logits, batch.label.float()))

    def new_totals(self) -> ScoredTotals:
        return ScoredTotals()

    def evaluate(self, batch: Any) -> ScoredTotals:
        logits = self._logits(batch)
        # .cpu() waits for the device; evaluation is not the hot path
        scores = logits.detach().cpu().numpy().astype("float32")
        labels = batch.label.detach().cpu().numpy().astype("uint8")
        loss = F.binary_cross_entropy_with_logits(logits, batch.label.float(), reduction="sum")
        return ScoredTotals(float(loss.item()), 0, len(labels), [scores], [labels])

    def describe(self) -> dict[str, Any]:
        return {"task": "ctr", "model": self.model_name, "num_dense": self.num_dense,
                "num_buckets": self.num_buckets, "embedding_dim": self.embedding_dim}
