"""Click-through-rate models over `TabularBatch(dense (B, D), sparse (B, F), label)`: DLRM and
DeepFM, each returning one logit per row.

    model = build_ctr_model("dlrm", num_dense=13, num_buckets=[2**18] * 26, dim=16)
    model.place("cuda", embeddings_on_cpu=True)   # tables in host memory, the rest on the GPU
    logits = model(batch.dense, batch.sparse)      # (B,) float

`FieldEmbeddings` holds one table per categorical field (`num_buckets[f]` rows, the loader's
`schema.num_buckets`), stored as one `nn.EmbeddingBag(mode="sum")` whose field f owns the rows
[offset_f, offset_f + num_buckets[f]): one lookup for all fields instead of one per field, the
same values as separate tables. Each bag holds one id today; a multi-hot field (a list of ids
per row) is a bag of several, summed, with no change to the models.

Tables on the CPU (`embeddings_on_cpu`): a Criteo-sized model is almost all embeddings (26
fields x 2**18 rows x 16 = 109 M parameters, 436 MB, three times that with AdamW's state)
while the network is a few hundred thousand. With the tables in host memory, the ids are
looked up there and only the pooled vectors (B x F x dim floats) cross to the device; in the
backward pass their gradients come back and the optimizer updates the tables on the host.
Costs, stated: the ids are read on the host (a device-to-host copy, one wait for the device a
step, when the loader delivered them to the device); the gradients are dense (every row of
every table updated each step, as on the device: AdamW has no sparse form); and DDP cannot
wrap a model on two device types (the tool refuses the flag under torchrun). The outputs are
those of the model all on one device (tests/test_ctr_task.py checks it on the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

CTRModelName = Literal["dlrm", "deepfm"]
MODELS: tuple[CTRModelName, ...] = ("dlrm", "deepfm")


class FieldEmbeddings(nn.Module):
    """(B, F) int64 ids, column f in [0, num_buckets[f]) -> (B, F, dim) on `out_device`."""

    def __init__(self, num_buckets: Sequence[int], dim: int, std: float = 0.01) -> None:
        super().__init__()
        if not num_buckets or min(num_buckets) < 1:
            raise ValueError(f"num_buckets={list(num_buckets)}: need one positive size per "
                             "categorical field")
        starts = torch.tensor([0, *num_buckets[:-1]], dtype=torch.int64).cumsum(0)
        self.register_buffer("offsets", starts.view(1, -1), persistent=False)
        self.bag = nn.EmbeddingBag(int(sum(num_buckets)), dim, mode="sum")
        nn.init.normal_(self.bag.weight, std=std)
        self.fields, self.dim = len(num_buckets), dim

    def forward(self, ids: torch.Tensor, out_device: torch.device) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != self.fields:
            raise ValueError(f"sparse ids of shape {tuple(ids.shape)}: expected (batch, "
                             f"{self.fields}), one column per categorical field")
        offsets: torch.Tensor = self.offsets  # type: ignore[assignment]
        # To the tables' device: a device-to-host copy (and a wait) when the tables are on
        # the host and the ids arrived on the device; nothing otherwise.
        rows = ids.to(offsets.device) + offsets
        pooled = self.bag(rows.reshape(-1, 1))  # one id per bag: sum = that row
        pooled = pooled.view(ids.shape[0], self.fields, self.dim)
        if pooled.device.type == "cpu" and torch.device(out_device).type == "cuda":
            # From pageable memory a non_blocking copy is staged through a bounce buffer
            # while the host waits; from pinned memory (torch's caching host allocator: the
            # same few buffers step after step) it is a DMA the host does not wait for.
            # pin_memory is differentiable: the gradients still reach the tables.
            pooled = pooled.pin_memory()
        return pooled.to(out_device, non_blocking=True)


def mlp(sizes: Sequence[int], last_activation: bool = True) -> nn.Sequential:
    """Linear layers of `sizes` with ReLU between them (and after the last, if asked)."""
    layers: list[nn.Module] = []
    for i, (cin, cout) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(cin, cout))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class CTRModel(nn.Module):
    """What both models share: the tables and their placement."""

    embeddings: FieldEmbeddings

    def place(self, device: torch.device | str, embeddings_on_cpu: bool = False) -> CTRModel:
        """Everything on `device`, or every FieldEmbeddings in host memory and the rest on
        `device` (the lookups then run on the host: see the module's docstring). The tables
        never visit the device on the way: they may not fit there."""
        if not embeddings_on_cpu:
            return self.to(device)
        for child in self.children():
            child.to("cpu" if isinstance(child, FieldEmbeddings) else device)
        for name, buffer in self._buffers.items():  # the model's own (DLRM's pair indices)
            if buffer is not None:
                self._buffers[name] = buffer.to(device)
        return self


class DLRM(CTRModel):
    """DLRM (Naumov et al., 2019): a bottom MLP takes the dense features to one `dim`
    vector; the dot products of every pair among it and the F field embeddings, beside the
    bottom vector itself, go through a top MLP to a logit. Without dense features (Avazu)
    there is no bottom MLP: the pairs of embeddings alone."""

    def __init__(self, num_dense: int, num_buckets: Sequence[int], dim: int = 16,
                 bottom: Sequence[int] = (64,), top: Sequence[int] = (128, 64)) -> None:
        super().__init__()
        self.embeddings = FieldEmbeddings(num_buckets, dim)
        self.bottom = mlp([num_dense, *bottom, dim]) if num_dense else None
        vectors = len(num_buckets) + (1 if num_dense else 0)
        pairs = vectors * (vectors - 1) // 2
        self.top = mlp([pairs + (dim if num_dense else 0), *top, 1], last_activation=False)
        lower = torch.tril_indices(vectors, vectors, offset=-1)
        self.register_buffer("pairs", lower, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        vectors = self.embeddings(sparse, dense.device)  # (B, F, dim)
        parts = []
        if self.bottom is not None:
            below = self.bottom(dense)
            vectors = torch.cat([below.unsqueeze(1).to(vectors.dtype), vectors], dim=1)
            parts.append(below)
        products = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, V, V)
        pairs: torch.Tensor = self.pairs  # type: ignore[assignment]
        parts.append(products[:, pairs[0], pairs[1]])  # each unordered pair once
        inputs = torch.cat([p.to(parts[-1].dtype) for p in parts], dim=1)
        return self.top(inputs).squeeze(1)


class DeepFM(CTRModel):
    """DeepFM (Guo et al., 2017): a first-order term (a weight per id, a linear map of the
    dense features), the factorization machine's second-order term over the field
    embeddings (every pair's dot product, in O(F dim)), and an MLP over the concatenated
    embeddings and dense features; the three summed into one logit. The FM term weighs
    every pair of fields alike, noise fields' too, where DLRM's top MLP learns which pairs
    matter: on the built-in click logs (20 noise fields of 26) DeepFM ends further from the
    achievable AUC (about 0.79 of 0.83 after one pass, DLRM about 0.82)."""

    def __init__(self, num_dense: int, num_buckets: Sequence[int], dim: int = 16,
                 hidden: Sequence[int] = (128, 64)) -> None:
        super().__init__()
        self.embeddings = FieldEmbeddings(num_buckets, dim)
        self.weights = FieldEmbeddings(num_buckets, 1, std=0.0)  # first order, from zero
        self.linear = nn.Linear(num_dense, 1) if num_dense else None
        self.deep = mlp([len(num_buckets) * dim + num_dense, *hidden, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        vectors = self.embeddings(sparse, dense.device)  # (B, F, dim)
        first = self.weights(sparse, dense.device).sum(dim=(1, 2))
        if self.linear is not None:
            first = first + self.linear(dense).squeeze(1)
        # sum over pairs <e_i, e_j> = ((sum_i e_i)^2 - sum_i e_i^2) / 2, per dimension
        second = 0.5 * (vectors.sum(1).pow(2) - vectors.pow(2).sum(1)).sum(1)
        deep_in = torch.cat([vectors.flatten(1), dense.to(vectors.dtype)], dim=1)
        return first.float() + second.float() + self.deep(deep_in).squeeze(1).float()


def build_ctr_model(name: str, num_dense: int, num_buckets: Sequence[int], dim: int = 16
                    ) -> CTRModel:
    """"dlrm" or "deepfm" for `num_dense` dense features and one table per categorical field
    (`num_buckets[f]` rows each, `dim` wide)."""
    if name not in MODELS:
        raise ValueError(f"--model {name}: choose one of {', '.join(MODELS)} for ctr")
    if dim < 1 or num_dense < 0:
        raise ValueError(f"embedding dim {dim}, {num_dense} dense features: need dim >= 1")
    if name == "dlrm":
        return DLRM(num_dense, list(num_buckets), dim)
    return DeepFM(num_dense, list(num_buckets), dim)
