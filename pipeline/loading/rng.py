"""Per-sample random generators: every random choice about a sample (its crop window and flip,
a cloud's rotation, scale, kept points and jitter) is drawn from (seed, epoch, key) alone, so
it does not depend on the batch, the rank, the reader, the thread or a resume.
"""

from __future__ import annotations

import random


def sample_rng(seed: int, epoch: int, key: str) -> random.Random:
    """The generator of sample `key` in `epoch` (string seeding hashes with SHA-512)."""
    return random.Random(f"aug/{seed}/{epoch}/{key}")
