"""Learning-rate schedule: linear warm-up, then cosine decay to `min_ratio` of the peak."""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
