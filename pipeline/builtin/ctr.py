"""Criteo-style click logs with a planted signal, for the tabular (CTR) pipeline and the demo.

``make_ctr_dataset(out, rows=60_000, files=1)`` writes ``out/part-00000.tsv``...: headerless
TSV in the layout of Criteo's click logs (``make_shards.py tabular ... --preset criteo``
reads it): a 0/1 label, 13 integer counts ``I1..I13`` and 26 categorical ids ``C1..C26`` as
8-digit hex strings, any of them possibly empty (missing), with Criteo-like missing shares,
long-tailed counts (I2 with a few negative values, as Criteo's) and Zipf-distributed ids
(3 to 50,000 distinct values per field).

Clicks follow a logistic model the data never shows: hidden weights of the values of four
fields (C2, C6, C14, C25; a missing C25 weighs 0), a pairwise interaction of C17 and C23
(the dot product of two hidden 2-vectors, which FM and DLRM's dot interaction express
exactly), and two log-count terms (``+0.3 log1p(I1)``, ``-0.15 log1p(I5)``, a missing count
counting as 0, as the loader's default fill does); the label is drawn from the true
probability. The other 20 fields and 11 counts are noise.

``out/planted.json`` records what a model can reach: ``achievable_auc`` and
``achievable_logloss``, those of the true probabilities on 200,000 fresh rows of the same
process (a figure of the process, within about 0.002 of the truth), beside the same figures
on the written rows, the click rate, and ``prior_logloss`` (predicting the click rate alone).
A run is judged by how close its held-out AUC gets to ``achievable_auc``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .images import fresh_out_dir

log = logging.getLogger(__name__)

PLANTED = "planted.json"
MISSING = np.iinfo(np.int64).min  # a missing count (counts can be negative)
FRESH_ROWS = 200_000  # rows behind achievable_auc: its sampling error is about 0.002
TARGET_CLICK_RATE = 0.25  # Criteo's is about 0.26

# Per count field: (mean and spread of log(count), share missing), like Criteo's I1..I13.
DENSE = ((1.0, 1.2, 0.45), (3.0, 1.8, 0.0), (2.0, 1.5, 0.21), (1.5, 1.0, 0.22),
         (7.5, 2.0, 0.03), (4.0, 1.6, 0.22), (2.0, 1.5, 0.04), (2.5, 1.0, 0.0),
         (4.0, 1.5, 0.04), (0.3, 0.6, 0.45), (1.0, 1.0, 0.04), (0.5, 1.0, 0.77),
         (2.0, 1.2, 0.22))
# Per categorical field: (distinct values, Zipf exponent, share missing), C1..C26.
CATEGORICAL = ((1000, 1.05, 0.0), (100, 0.5, 0.0), (50_000, 1.05, 0.03), (20_000, 1.05, 0.03),
               (200, 1.05, 0.0), (20, 0.5, 0.0), (8000, 1.05, 0.0), (500, 1.05, 0.0),
               (3, 1.05, 0.0), (20_000, 1.05, 0.0), (4000, 1.05, 0.0), (30_000, 1.05, 0.03),
               (3000, 1.05, 0.0), (25, 0.5, 0.0), (6000, 1.05, 0.0), (25_000, 1.05, 0.03),
               (10, 0.5, 0.0), (3000, 1.05, 0.0), (2000, 1.05, 0.44), (4, 1.05, 0.44),
               (25_000, 1.05, 0.03), (15, 1.05, 0.76), (15, 0.5, 0.0), (10_000, 1.05, 0.03),
               (80, 0.5, 0.44), (8000, 1.05, 0.44))
MAIN_EFFECTS = {2: 0.6, 6: 0.8, 14: 0.8, 25: 0.5}  # field number (C2...) -> weight spread
INTERACTION = (17, 23, 0.9)  # C17 x C23: dot product of 2-vectors of this spread
DENSE_TERMS = {1: 0.3, 5: -0.15}  # count number (I1...) -> coefficient of log1p(count)
NEGATIVE = (2, 0.02)  # I2 holds -1..-3 in 2% of rows, as Criteo's does (log1p reads them as 0)


@dataclass
class Rows:
    """Drawn rows before formatting: counts (N, 13) int64 (MISSING where missing) and ids
    (N, 26) int64 (-1 where missing); the true click probability and label of each row."""

    counts: np.ndarray
    ids: np.ndarray
    truth: np.ndarray
    label: np.ndarray

    @classmethod
    def joined(cls, parts: list[Rows]) -> Rows:
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)))


@dataclass(frozen=True)
class Signal:
    """The hidden weights of one seed: per main-effect field a weight per value, the two
    interaction tables, and the bias that sets the click rate."""

    main: dict[int, np.ndarray]
    left: np.ndarray
    right: np.ndarray
    bias: float

    @classmethod
    def of_seed(cls, seed: int) -> Signal:
        rng = np.random.default_rng([seed, 1])
        main = {f: rng.normal(0.0, spread, CATEGORICAL[f - 1][0])
                for f, spread in MAIN_EFFECTS.items()}
        a, b, spread = INTERACTION
        left = rng.normal(0.0, spread, (CATEGORICAL[a - 1][0], 2))
        right = rng.normal(0.0, spread, (CATEGORICAL[b - 1][0], 2))
        unbiased = cls(main, left, right, 0.0)
        counts, ids = _draw_fields(np.random.default_rng([seed, 2]), 20_000)
        return cls(main, left, right, _bias_for(unbiased.logit(counts, ids)))

    def logit(self, counts: np.ndarray, ids: np.ndarray) -> np.ndarray:
        z = np.full(len(ids), self.bias)
        for field, weights in self.main.items():
            column = ids[:, field - 1]
            z += np.where(column >= 0, weights[np.maximum(column, 0)], 0.0)
        a, b, _ = INTERACTION
        z += np.einsum("nk,nk->n", self.left[ids[:, a - 1]], self.right[ids[:, b - 1]])
        for number, coefficient in DENSE_TERMS.items():
            z += coefficient * np.log1p(np.maximum(counts[:, number - 1], 0))
        return z


def make_ctr_dataset(out: str | Path, rows: int = 60_000, files: int = 1, seed: int = 0
                     ) -> Path:
    """Write `rows` rows in `files` TSV files (``part-00000.tsv``...) and ``planted.json``
    into the new or empty folder `out`; returns it. The same arguments give the same bytes."""
    if rows < files or files < 1:
        raise ValueError(f"rows={rows}, files={files}: need at least one file and one row "
                         "per file")
    out = fresh_out_dir(out)
    signal = Signal.of_seed(seed)
    written = []
    for index, count in enumerate(np.diff(np.linspace(0, rows, files + 1).astype(int))):
        drawn = draw_rows(signal, np.random.default_rng([seed, 3, index]), int(count))
        path = out / f"part-{index:05d}.tsv"
        path.write_text(format_rows(drawn, seed), encoding="ascii")
        written.append(drawn)
    fresh = draw_rows(signal, np.random.default_rng([seed, 4]), FRESH_ROWS)
    facts = planted_facts(signal, Rows.joined(written), fresh)
    (out / PLANTED).write_text(json.dumps({"seed": seed, "rows": rows, "files": files,
                                           **facts}, indent=1) + "\n")
    log.info("wrote %d click-log rows into %s (achievable AUC %.3f)", rows, out,
             facts["achievable_auc"])
    return out


def draw_rows(signal: Signal, rng: np.random.Generator, n: int) -> Rows:
    """`n` rows of the process: fields, true probabilities, labels drawn from them."""
    counts, ids = _draw_fields(rng, n)
    truth = 1.0 / (1.0 + np.exp(-signal.logit(counts, ids)))
    return Rows(counts, ids, truth, (rng.random(n) < truth).astype(np.int64))


def _draw_fields(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.empty((n, len(DENSE)), np.int64)
    for j, (mean, spread, missing) in enumerate(DENSE):
        values = np.floor(np.exp(rng.normal(mean, spread, n))).astype(np.int64)
        if j == NEGATIVE[0] - 1:
            values = np.where(rng.random(n) < NEGATIVE[1], -rng.integers(1, 4, n), values)
        counts[:, j] = np.where(rng.random(n) < missing, MISSING, values)
    ids = np.empty((n, len(CATEGORICAL)), np.int64)
    for j, (distinct, exponent, missing) in enumerate(CATEGORICAL):
        weights = 1.0 / np.arange(1, distinct + 1) ** exponent
        values = rng.choice(distinct, n, p=weights / weights.sum())
        ids[:, j] = np.where(rng.random(n) < missing, -1, values)
    return counts, ids


def _bias_for(logit: np.ndarray) -> float:
    """The bias that makes the mean click probability TARGET_CLICK_RATE (bisection)."""
    low, high = -10.0, 10.0
    for _ in range(50):
        mid = (low + high) / 2
        rate = np.mean(1.0 / (1.0 + np.exp(-(logit + mid))))
        low, high = (mid, high) if rate < TARGET_CLICK_RATE else (low, mid)
    return round((low + high) / 2, 6)


def format_rows(rows: Rows, seed: int) -> str:
    """Criteo's text: label, 13 counts, 26 hex ids, tab-separated; missing fields empty."""
    columns = [rows.label.astype(str)]
    for j in range(rows.counts.shape[1]):
        values = rows.counts[:, j]
        columns.append(np.where(values != MISSING, values.astype(str), ""))
    for j in range(rows.ids.shape[1]):
        table = hex_ids(j, CATEGORICAL[j][0], seed)
        values = rows.ids[:, j]
        columns.append(np.where(values >= 0, table[np.maximum(values, 0)], ""))
    return "".join("\t".join(line) + "\n" for line in
                   zip(*(c.tolist() for c in columns), strict=True))


def hex_ids(field: int, distinct: int, seed: int) -> np.ndarray:
    """The strings of one field's values: 8 hex digits like Criteo's hashed ids, distinct
    within and across fields (murmur3's finaliser is a bijection of 32-bit integers)."""
    h = (np.uint32(field) << np.uint32(24)) | np.arange(distinct, dtype=np.uint32)
    h ^= np.uint32(seed * 0x9E3779B1 & 0xFFFFFFFF)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return np.array([f"{v:08x}" for v in h.tolist()])


def planted_facts(signal: Signal, written: Rows, fresh: Rows) -> dict[str, object]:
    """What planted.json says: the achievable figures, the click rate, the signal."""
    rate = float(written.label.mean())
    return {
        "achievable_auc": round(roc_auc(fresh.label, fresh.truth), 4),
        "achievable_logloss": round(logloss(fresh.label, fresh.truth), 4),
        "achievable_auc_on_written_rows": round(roc_auc(written.label, written.truth), 4),
        "click_rate": round(rate, 4),
        "prior_logloss": round(logloss(written.label, np.full(len(written.label), rate)), 4),
        "signal": {"main_effects": [f"C{f}" for f in MAIN_EFFECTS],
                   "interaction": [f"C{INTERACTION[0]}", f"C{INTERACTION[1]}"],
                   "log1p_counts": {f"I{k}": v for k, v in DENSE_TERMS.items()},
                   "bias": signal.bias},
        "fresh_rows": FRESH_ROWS,
    }


def roc_auc(label: np.ndarray, score: np.ndarray) -> float:
    """Rank-based AUC, ties counted half (the same definition as trainers/ctr_metrics.py,
    kept here because the data side does not import the trainers)."""
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # 1-based mean rank of ties
    positive = label.astype(bool)
    pos, neg = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def logloss(label: np.ndarray, probability: np.ndarray) -> float:
    p = np.clip(probability, 1e-12, 1 - 1e-12)
    return float(-np.mean(label * np.log(p) + (1 - label) * np.log1p(-p)))
