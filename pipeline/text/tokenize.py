"""A read's documents to tokens: back to back, each ended by the separator (a Piece's form).

    (texts, urls, keys) of a read -> tokenizer -> (tokens int32, starts int64)

The byte tokenizer encodes a whole read in a few numpy calls (`encode_packed`), not a few
calls per document: with bytes, Python's work per document is what bounds the loader. HF's
tokenizer encodes in Rust threads with the GIL released, so the loader runs it `AHEAD` reads
in front in helper threads (`ahead` of pipeline/loading/prefetch.py) while its own thread packs and
masks; called in the loader's own thread, the rest of the stage's work waited on it. A
document cut by an elastic resume (text/elastic.py) goes through the per-document path.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar

import numpy as np

from shardflow.loading.prefetch import ahead
from shardflow.text import elastic, packing
from shardflow.text.tokenizer import Tokenizer

# Where the tokenizer releases the GIL: reads tokenized ahead of the one being packed, and
# the helper threads doing it. Two helpers, so that one encodes (in Rust, on every core) while
# the other waits for the GIL to turn its ids into arrays: with one, the encoder sat idle in
# that wait (measured on 2 cores with reads of 64 documents: 0.78-0.84x `encode_batch` alone
# with 1 helper and 2 reads ahead, 0.88-0.92x with 2 and 4; with reads of 256, 2 ahead did as
# well as 4). Memory: up to AHEAD reads of documents and their tokens besides the loader's.
AHEAD = 2
HELPERS = 2

A = TypeVar("A")
R = TypeVar("R")
Documents = tuple[list[str], list[str], list[str]]  # (texts, urls, keys) of one read


def releases_gil(tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer` encodes outside the GIL (says so with `releases_gil = True`), so
    that a helper thread running it leaves this one free."""
    return bool(getattr(tokenizer, "releases_gil", False))


def packed(tokenizer: Tokenizer, docs: Documents, *, cut: dict[tuple[int, str], int],
           ids: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """The read's documents as (tokens, starts); `cut`: tokens to drop at the start of the
    documents an elastic resume starts late, by (shard index, key) (`ids`: URL -> index)."""
    texts, urls, keys = docs
    if not texts:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    fast = getattr(tokenizer, "encode_packed", None)
    if fast is not None and not cut:
        tokens, starts = fast(texts, tokenizer.sep_id)
        return tokens, starts
    encoded = elastic.trim(tokenizer.encode_batch(texts), urls, keys, ids, cut)
    return packing.join(encoded, tokenizer.sep_id)


def stored(sep_id: int, docs: tuple[Any, list[str], list[str]], *,
           cut: dict[tuple[int, str], int], ids: dict[str, int]
           ) -> tuple[np.ndarray, np.ndarray]:
    """`packed` for stored token ids (pretokenized.py): the read as the loader packed it, or
    its documents' ids, joined; documents an elastic resume starts late are cut first."""
    found, urls, keys = docs
    if isinstance(found, tuple):
        if not cut:
            return found
        found = packing.documents(*found)
    if not found:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    return packing.join(elastic.trim(found, urls, keys, ids, cut), sep_id)


def mapped(fn: Callable[[Any], R], items: Iterable[tuple[A, Any]], depth: int
           ) -> Generator[tuple[A, R], None, None]:
    """(a, fn(b)) for each (a, b) of `items`, in order; fn in helper threads `depth` ahead
    (0: here). Close it when done early: that ends the helpers."""
    if depth == 0:
        return ((a, fn(b)) for a, b in items)
    return ahead(fn, items, depth, name="shardflow-tokenize", workers=HELPERS)
