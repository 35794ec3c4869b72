"""Dynamic masking for masked language modelling, and causal-LM labels.

BERT's recipe: of the ordinary tokens (not padding, not separators) each is chosen with
probability `prob` (15%); a chosen token becomes the mask token 80% of the time, a random
ordinary token 10%, and stays itself 10%; the loss is taken on chosen tokens only (labels
elsewhere are -100, what cross-entropy ignores). The draws come from a generator seeded by
(seed, epoch, rank, batch index): fresh every epoch, identical after a resume.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

IGNORE = -100  # label value that cross_entropy(ignore_index=-100) skips


class MaskDraws:
    """Each batch's generator, its PCG64 state hashed from (seed, epoch, rank, batch). One bit
    generator, set anew per batch: seeding a fresh one (numpy's SeedSequence) took a tenth
    of the pre-tokenized text loader's time, setting a state a fifth of that. A generator
    handed out is good until the next `batch` call: one thread's, used at once."""

    def __init__(self) -> None:
        self._bits = np.random.PCG64(0)

    def batch(self, seed: int, epoch: int, rank: int, batch: int) -> np.random.Generator:
        key = struct.pack("<4Q", *(v % 2**64 for v in (seed, epoch, rank, batch)))
        digest = hashlib.blake2b(key, digest_size=32, person=b"shardflow-mask").digest()
        self._bits.state = {"bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0, "state": {
            "state": int.from_bytes(digest[:16], "little"),
            "inc": int.from_bytes(digest[16:], "little") | 1}}  # PCG's increment is odd
        return np.random.Generator(self._bits)


def batch_rng(seed: int, epoch: int, rank: int, batch: int) -> np.random.Generator:
    """A batch's generator of its own (MaskDraws.batch's draws, on a new bit generator)."""
    return MaskDraws().batch(seed, epoch, rank, batch)


def mlm(ids: np.ndarray, attention: np.ndarray, rng: np.random.Generator, *, mask_id: int,
        normal_ids: np.ndarray, special_ids: tuple[int, ...], prob: float = 0.15
        ) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) for a batch of rows.

    One uniform draw u per token decides it all: chosen when u < prob, and then u / prob is
    itself uniform in [0, 1), so u < 0.8 prob is "mask" and 0.8 prob <= u < 0.9 prob "random
    token": BERT's proportions from one array instead of two float64 ones and a set lookup.
    The draws are 16-bit integers, the bit generator's raw output cut in four (a third of
    the time of float32 draws), so `prob` holds to within 1/65536. Past the draw, only the
    ~15% of positions drawn are looked at (special tokens and padding are left out there),
    which made it 2x faster again; the plain-loop baseline of bench_loader uses this
    function too."""
    flat = ids.reshape(-1)
    u = rng.bit_generator.random_raw(-(-flat.size // 4)).view(np.uint16)[: flat.size]
    chosen = round(prob * 65536)
    at = np.flatnonzero(u < chosen)
    tokens = flat[at]
    keep = attention.reshape(-1)[at] != 0
    keep &= ~_special(tokens, special_ids)
    at, tokens, drawn = at[keep], tokens[keep], u[at[keep]]
    labels = np.full(flat.shape, IGNORE, dtype=ids.dtype)
    labels[at] = tokens
    inputs = flat.copy()
    inputs[at[drawn < chosen * 8 // 10]] = mask_id
    swap = at[(drawn >= chosen * 8 // 10) & (drawn < chosen * 9 // 10)]
    if len(swap):
        inputs[swap] = normal_ids[rng.integers(0, len(normal_ids), len(swap))]
    return inputs.reshape(ids.shape), labels.reshape(ids.shape)


def _special(ids: np.ndarray, special_ids: tuple[int, ...]) -> np.ndarray:
    """Where `ids` holds a special token: a comparison per id for the usual few (pad,
    separator, mask), np.isin for tokenizers with many added tokens."""
    if len(special_ids) > 8:
        return np.isin(ids, special_ids)
    found = np.zeros(ids.shape, dtype=bool)
    for token in special_ids:
        found |= ids == token
    return found


def clm(ids: np.ndarray, attention: np.ndarray) -> np.ndarray:
    """Labels for next-token prediction: the ids themselves (the model shifts), padding ignored.
    Separators are kept as targets: the model learns where a document ends."""
    return np.where(attention == 1, ids, IGNORE)
