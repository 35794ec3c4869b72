"""Feature hashing: categorical values (UTF-8 bytes) -> ids in [0, num_buckets), vectorised in
numpy over a block's blob and offsets, stable across processes, machines and versions.

The hash (version 1, `HASH_VERSION`): a 64-bit value per (field seed, bytes),

    h = fmix64(field_seed ^ (len * K))
    for each 8-byte little-endian word w of the bytes (the last one zero-padded):
        h = fmix64(h ^ w)

with murmur3's 64-bit finalizer `fmix64` (a bijection that mixes every input bit into every
output bit) and K = 0x9E3779B97F4A7C15. The length enters first, so values that differ only
by trailing zero bytes differ. `field_seed` is drawn from (hash_seed, field index) with
splitmix64, so every field hashes independently: the same string in two fields lands in
unrelated buckets. Never Python's `hash()`, which is salted per process.

Ids: a missing value (empty bytes: an empty CSV field, a Parquet null) is id 0 in every field;
a present value is `1 + ((h >> 32) * (num_buckets - 1) >> 32)` (the high half of the hash
scaled to [0, num_buckets - 1): a multiply and a shift, spread as evenly as a modulo), so
num_buckets is at most 2^32. A table of `num_buckets` rows therefore has one
row for "missing" and `b = num_buckets - 1` rows shared by the values by hash.

Collisions: n distinct values hashed into b buckets occupy on average b (1 - (1 - 1/b)^n)
buckets, so about n - b (1 - (1 - 1/b)^n) values share a bucket with an earlier one
(`expected_collisions`; roughly n^2 / (2b) while n is much smaller than b). For example
100,000 distinct ids in 2^18 buckets: about 17,000 collide (17%); in 2^20: about 4,600
(4.6%). Colliding values share an embedding; frequent values dominate it. Size
`num_buckets` per field from the distinct counts when they are known.

The loop runs once per 8-byte word of the longest value, over the values that long only, so a
table of short ids (Criteo's 8 hex digits: one word) costs a handful of numpy passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

HASH_VERSION = 1
MASK = (1 << 64) - 1
K = 0x9E3779B97F4A7C15
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53
_S1, _S2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def field_seeds(hash_seed: int, fields: int) -> np.ndarray:
    """uint64 (fields,): each field's seed, splitmix64 of (hash_seed, field index)."""
    return np.array([_splitmix(hash_seed * 0x100000001B3 + f) for f in range(fields)],
                    dtype=np.uint64)


def _splitmix(x: int) -> int:
    z = (x + K) & MASK
    z = ((z ^ (z >> 30)) * _S1) & MASK
    z = ((z ^ (z >> 27)) * _S2) & MASK
    return z ^ (z >> 31)


def _fmix(h: np.ndarray) -> np.ndarray:
    """murmur3's fmix64 on a uint64 array, in place (numpy's uint64 multiply wraps)."""
    h ^= h >> np.uint64(33)
    h *= np.uint64(_C1)
    h ^= h >> np.uint64(33)
    h *= np.uint64(_C2)
    h ^= h >> np.uint64(33)
    return h


def hash64(blob: np.ndarray, offsets: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """uint64 (V,): the hash of each value blob[offsets[v]:offsets[v+1]] with seeds[v]."""
    words = _words(blob)
    starts = offsets[:-1].astype(np.int64)
    lengths = offsets[1:].astype(np.int64) - starts
    out = np.empty(len(starts), dtype=np.uint64)
    # In slices that stay in the CPU's cache: each step is a pass over its array, and over
    # the whole block those passes would run at memory speed.
    for lo in range(0, len(out), CHUNK):
        hi = lo + CHUNK
        out[lo:hi] = _hash_slice(words, starts[lo:hi], lengths[lo:hi], seeds[lo:hi])
    return out


CHUNK = 32768  # values hashed per slice


def _words(blob: np.ndarray) -> np.ndarray:
    """Every byte offset of the blob as the start of a little-endian 8-byte word (a strided
    view over a copy padded with 8 zero bytes): a value's words are gathered at once."""
    padded = np.zeros(len(blob) + 8, dtype=np.uint8)
    padded[: len(blob)] = blob
    return np.ndarray((len(blob) + 1,), dtype="<u8", buffer=padded, strides=(1,))


def _hash_slice(words: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                seeds: np.ndarray, empty_matters: bool = True) -> np.ndarray:
    """The hashes of one slice of values. Without `empty_matters` the hash of an empty value
    is left undefined (its id is 0 whatever it is), which spares a gather when the values
    are all one word or empty (Criteo's ids with their missing ones)."""
    with np.errstate(over="ignore"):
        h = _fmix(seeds.astype(np.uint64) ^ (lengths.astype(np.uint64) * np.uint64(K)))
        longest = int(lengths.max()) if len(lengths) else 0
        todo: np.ndarray | None = None  # None: every value (no gather needed)
        for j in range(0, longest, 8):
            done = (lengths <= j) if empty_matters else (lengths <= j) & (lengths > 0)
            if todo is not None or done.any():
                todo = np.flatnonzero(lengths > j) if todo is None else todo[lengths[todo] > j]
            left = lengths - j if todo is None else lengths[todo] - j
            w = words[starts + j if todo is None else starts[todo] + j]
            short = left < 8
            if short.any():  # the last word: only its `left` low bytes are the value's
                w[short] &= (np.uint64(1) << (left[short].astype(np.uint64) * np.uint64(8))) \
                    - np.uint64(1)
            if todo is None:
                h ^= w
                _fmix(h)
            else:
                h[todo] = _fmix(h[todo] ^ w)
    return h


def bucket_ids(blob: np.ndarray, offsets: np.ndarray, rows: int, num_buckets: np.ndarray,
               seeds: np.ndarray) -> np.ndarray:
    """int64 (rows, F): the ids of a block's field-major values (F fields of `rows` values;
    see pipeline/samples/tabular_block.py); 0 where a value is missing."""
    fields = len(num_buckets)
    if rows == 0 or fields == 0:
        return np.zeros((rows, fields), dtype=np.int64)
    words = _words(blob)
    starts = offsets[:-1].astype(np.int64)
    lengths = offsets[1:].astype(np.int64) - starts
    value_seeds = np.repeat(seeds.astype(np.uint64), rows)
    shared = np.repeat(num_buckets.astype(np.uint64) - np.uint64(1), rows)
    out = np.empty(rows * fields, dtype=np.uint64)
    for lo in range(0, len(out), CHUNK):  # field-major, as the blob lies: reads in order
        hi = min(lo + CHUNK, len(out))
        h = _hash_slice(words, starts[lo:hi], lengths[lo:hi], value_seeds[lo:hi], False)
        # The high 32 bits scaled to [0, b): Lemire's multiply-shift, cheaper than a modulo.
        h >>= np.uint64(32)
        h *= shared[lo:hi]
        h >>= np.uint64(32)
        h += np.uint64(1)
        h[lengths[lo:hi] == 0] = 0  # missing
        out[lo:hi] = h
    return np.ascontiguousarray(out.view(np.int64).reshape(fields, rows).T)


def hash_value(data: bytes, seed: int) -> int:
    """The same 64-bit hash in plain Python, one value at a time (the reference the tests and
    the benchmark's plain loop use)."""
    h = _fmix_int(seed ^ ((len(data) * K) & MASK))
    for j in range(0, len(data), 8):
        h = _fmix_int(h ^ int.from_bytes(data[j: j + 8], "little"))
    return h


def _fmix_int(h: int) -> int:
    h ^= h >> 33
    h = (h * _C1) & MASK
    h ^= h >> 33
    h = (h * _C2) & MASK
    return h ^ (h >> 33)


def bucket_id(data: bytes, seed: int, num_buckets: int) -> int:
    """One value's id in plain Python (0 for missing), as `bucket_ids` computes it."""
    return 0 if not data else 1 + ((hash_value(data, seed) >> 32) * (num_buckets - 1) >> 32)


def expected_collisions(distinct: int, num_buckets: int) -> float:
    """Distinct present values expected to share a bucket with another, for `distinct`
    values hashed into `num_buckets` ids (one of which is kept for missing values)."""
    b = num_buckets - 1
    return distinct - b * (1.0 - (1.0 - 1.0 / b) ** distinct)


def as_buckets(num_buckets: int | Sequence[int], fields: int) -> np.ndarray:
    """int64 (fields,): one bucket count per field (an int is used for every field)."""
    if isinstance(num_buckets, int):
        return np.full(fields, num_buckets, dtype=np.int64)
    if len(num_buckets) != fields:
        raise ValueError(f"num_buckets has {len(num_buckets)} entries for {fields} categorical "
                         "fields: give one per field, or one int for all")
    return np.array(num_buckets, dtype=np.int64)
