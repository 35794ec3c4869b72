"""Packed text resumed on another number of ranks: what a rank's position says it had read.

A packed position is (the reader's state before the first read not used up, tokens of that
read emitted): the reader's snapshot (pipeline/loading/consumed.py) covers the reads before.
Of the read in progress, the documents whose tokens all went out are read too, and so are its
samples that never became documents (skipped, held out); the one document cut between two
batches is read up to a number of tokens. A batch's state carries that as

    {"also": [[shard, key], ...], "cut": [shard, key, tokens] or None}

so that the rest of the epoch, on any ranks, starts that document at its next token and reads
none of the others twice (`offsets`, `trim`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from shardflow.loading.deferred import Deferred
from shardflow.text.packing import Packer, Piece


def in_progress(packer: Packer[Piece], ids: dict[str, int]) -> Deferred | None:
    """What the packer's first read has used up (the module docstring's form), written out
    when the state is used (loading/deferred.py): a piece changes only its offset. What the
    Deferred keeps is the read's layout, not the piece: its tokens (a read's worth) would stay
    alive with every state that holds it."""
    if not packer.reads or not ids:
        return None
    p = packer.reads[0]
    return Deferred(functools.partial(_used_up, p.starts, len(p.tokens), p.urls, p.keys, p.read,
                                      p.offset, ids))


def _used_up(starts: np.ndarray, total: int, urls: list[str], keys: list[str],
             read: list[tuple[str, str]], offset: int, ids: dict[str, int]) -> dict[str, Any]:
    ends = np.append(starts[1:], total)
    open_docs = {(urls[d], keys[d]) for d in range(len(keys)) if ends[d] > offset}
    also = [[ids[u], k] for u, k in read if (u, k) not in open_docs and u in ids]
    cut = next(([ids[urls[d]], keys[d], int(offset - starts[d])] for d in range(len(keys))
                if starts[d] < offset < ends[d] and urls[d] in ids), None)
    return {"also": also, "cut": cut}


def consumed_of(reader_state: dict[str, Any] | None) -> list[dict[str, Any] | None]:
    """The snapshots a saved text rank's position stands for (see Loader._consumed_of)."""
    if not reader_state:
        return [None]
    before = reader_state.get("reader")
    # No reader state before: the read in progress is the epoch's first; nothing before it.
    snaps = [before.get("consumed") if before else {"done": [], "partial": []}]
    extra = reader_state.get("elastic")
    if extra:
        by_shard: dict[int, list[str]] = {}
        for i, key in extra["also"]:
            by_shard.setdefault(int(i), []).append(key)
        snaps.append({"done": [], "partial": [[i, keys] for i, keys in by_shard.items()]})
    return snaps


def offsets(ranks: list[dict[str, Any]], epoch: int, old: dict[str, Any] | None
            ) -> list[list[Any]]:
    """[[shard, key, tokens], ...]: where the rest of `epoch` starts each cut document; a
    document cut again after an earlier resume started it late adds both."""
    earlier = old.get("offsets", []) if old and int(old["epoch"]) == epoch else []
    start = {(int(i), k): int(t) for i, k, t in earlier}
    found = dict(start)
    for entry in ranks:
        state = entry.get("reader_state") or {}
        cut = (state.get("elastic") or {}).get("cut")
        if int(entry["epoch"]) == epoch and cut:
            i, key, tokens = int(cut[0]), cut[1], int(cut[2])
            found[(i, key)] = start.get((i, key), 0) + tokens
    return [[i, k, t] for (i, k), t in sorted(found.items())]


def trim(docs: list[np.ndarray], urls: list[str], keys: list[str], ids: dict[str, int],
         cut: dict[tuple[int, str], int]) -> list[np.ndarray]:
    """`docs`, each one cut before a resume starting at its next token."""
    if not cut:
        return docs
    out = []
    for doc, url, key in zip(docs, urls, keys, strict=True):
        skip = cut.get((ids.get(url, -1), key), 0)
        out.append(doc[skip:] if skip else doc)
    return out
