"""Language modelling: a small BERT-style encoder ("mlm") or GPT-style decoder ("clm") over
`TextBatch(input_ids, labels, attention_mask, keys)`.

Both are the same pre-norm transformer with tied input/output embeddings and ALiBi position
biases (each head penalises attention by distance, with its own slope; the decoder also masks
the future). The distance bias is what makes a small byte-level model use its neighbours from
the first steps: with learned absolute positions a masked-LM sat at the unigram entropy for
hundreds of steps before it found them.

The loss is cross-entropy over the positions whose label is not -100: the masked tokens for
"mlm", every next token for "clm" (labels shifted here, as HF does). Evaluation sums the
loss, the correct top-1 predictions and the token count, so its `eval_loss` is nats per
predicted token and `accuracy` the share predicted exactly."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardflow.trainers.task import EvalTotals, StepOutput

IGNORE = -100
# "Never attend" as a finite number: a row of -inf (a padded query in some kernels) gives NaN;
# -1e4 underflows to weight 0 in softmax and fits fp16 and bf16.
BLOCKED = -1e4


@dataclass(frozen=True)
class LMShape:
    """The model's size; the defaults train in minutes on two CPU cores."""

    vocab_size: int
    seq_len: int
    width: int = 128
    layers: int = 3
    heads: int = 4
    ff_mult: int = 4
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(
            2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.to(q.dtype), dropout_p=self.dropout if self.training else 0.0)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, shape: LMShape, causal: bool) -> None:
        super().__init__()
        self.shape, self.causal = shape, causal
        self.embed = nn.Embedding(shape.vocab_size, shape.width)
        self.blocks = nn.ModuleList(
            Block(shape.width, shape.heads, shape.width * shape.ff_mult, shape.dropout)
            for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.width)
        nn.init.normal_(self.embed.weight, std=0.02)
        slopes = 2.0 ** (-8.0 * torch.arange(1, shape.heads + 1) / shape.heads)
        self.register_buffer("slopes", slopes.view(-1, 1, 1), persistent=False)

    def bias(self, attention: torch.Tensor) -> torch.Tensor:
        """The additive attention mask, (batch, heads, L, L): -slope * distance, BLOCKED for
        padded keys and (decoder) for the future."""
        length = attention.shape[1]
        where = torch.arange(length, device=attention.device)
        distance = (where.view(1, -1) - where.view(-1, 1)).abs().float()
        slopes: torch.Tensor = self.slopes  # type: ignore[assignment]
        bias = -slopes * distance  # (heads, L, L)
        if self.causal:
            bias = bias.masked_fill(where.view(1, -1) > where.view(-1, 1), BLOCKED)
        padded = (attention == 0).view(-1, 1, 1, length)  # (batch, 1, 1, L): keys
        return bias.unsqueeze(0).masked_fill(padded, BLOCKED)

    def forward(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        x, bias = self.embed(ids), self.bias(attention)
        for block in self.blocks:
            x = block(x, bias)
        return self.norm(x) @ self.embed.weight.t()  # tied output embedding


class LanguageModelling:
    """The Task for text: `objective` "mlm" (encoder) or "clm" (decoder)."""

    def __init__(self, objective: str, vocab_size: int, seq_len: int,
                 device: torch.device | str = "cpu", **shape: Any) -> None:
        if objective not in ("mlm", "clm"):
            raise ValueError(f"objective={objective!r}: choose mlm or clm")
        self.objective = objective
        self.shape = LMShape(vocab_size, seq_len, **shape)
        self.device = torch.device(device)
        self.model = TinyTransformer(self.shape, causal=objective == "clm").to(self.device)

    def _logits_and_targets(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(batch.input_ids, batch.attention_mask).float()
        if self.objective == "clm":  # position t predicts token t + 1
            return logits[:, :-1], batch.labels[:, 1:]
        return logits, batch.labels

    def forward(self, batch: Any) -> StepOutput:
        logits, targets = self._logits_and_targets(batch)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                ignore_index=IGNORE, reduction="sum")
        # The mean over predicted tokens; a batch with none (a short last batch in which no
        # token was masked) gives 0, not the NaN of 0/0 that would count as a diverged step.
        return StepOutput(total / (targets != IGNORE).sum().clamp(min=1))

    def evaluate(self, batch: Any) -> EvalTotals:
        logits, targets = self._logits_and_targets(batch)
        flat, wanted = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        loss = F.cross_entropy(flat, wanted, ignore_index=IGNORE, reduction="sum")
        counted = wanted != IGNORE
        correct = ((flat.argmax(-1) == wanted) & counted).sum()
        return EvalTotals(float(loss.item()), int(correct.item()), int(counted.sum().item()))

    def describe(self) -> dict[str, Any]:
        return {"task": "text", "objective": self.objective, **asdict(self.shape)}
