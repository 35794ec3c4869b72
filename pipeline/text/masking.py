"""Dynamic masking for masked language modelling, and causal-LM labels.

BERT's recipe: of the ordinary tokens (not padding, not separators) each is chosen with
probability `prob` (15%); a chosen token becomes the mask token 80% of the time, a random
ordinary token 10%, and stays itself 10%; the loss is taken on chosen tokens only (labels
elsewhere are -100, what cross-entropy ignores). The draws come from a generator seeded by
(seed, epoch, rank, batch index): fresh every epoch, identical after a resume.
"""

from __future__ import annotations

import numpy as np

IGNORE = -100  # label value that cross_entropy(ignore_index=-100) skips


def batch_rng(seed: int, epoch: int, rank: int, batch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, rank, batch, 0x6D61736B])  # "mask"


def mlm(ids: np.ndarray, attention: np.ndarray, rng: np.random.Generator, *, mask_id: int,
        normal_ids: np.ndarray, special_ids: tuple[int, ...], prob: float = 0.15
        ) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) for a batch of rows."""
    candidates = (attention == 1) & ~np.isin(ids, special_ids)
    chosen = candidates & (rng.random(ids.shape) < prob)
    labels = np.where(chosen, ids, IGNORE)
    roll = rng.random(ids.shape)
    inputs = ids.copy()
    inputs[chosen & (roll < 0.8)] = mask_id
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = normal_ids[rng.integers(0, len(normal_ids), int(swap.sum()))]
    return inputs, labels


def clm(ids: np.ndarray, attention: np.ndarray) -> np.ndarray:
    """Labels for next-token prediction: the ids themselves (the model shifts), padding ignored.
    Separators are kept as targets: the model learns where a document ends."""
    return np.where(attention == 1, ids, IGNORE)
