"""Taking part of a dataset at load time, by key (every loader but the tabular one's rows).

    image_loader(src, batch_size=64, subsample=0.1)            # a tenth, by (seed, key) hash
    image_loader(src, batch_size=64, keys="keep.txt")          # a file of keys, one a line
    image_loader(src, batch_size=64, keys=bad, exclude=True)   # every sample but those
    image_loader(src, batch_size=64, select=lambda key, m: m["cls"] in (b"3", b"7"))

Whether a sample is taken is decided from its key, and for `select` from the small members
the reader already has (`cls`: the label's bytes or None, and each member the loader reads as
`extras`), where the reader stage first sees it, before any check or decode. So the same
samples are taken on every rank, in every epoch, after a resume and whatever the reader, and
exact and elastic resume hold as without a subset. Conditions given together must all hold.

As for a holdout split (holdout.py), an epoch keeps its reads: `len()` is unchanged, and a
batch holds only the samples taken (about `subsample` of `batch_size`); packed text packs only
the documents taken. Samples left out are counted in `loader.left_out` (read-ahead and a
resume's re-reads included), apart from `loader.skipped`, which counts bad data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardflow.loading.batch import EncodedBatch

Select = Callable[[str, Mapping[str, Any]], bool]


@dataclass(frozen=True)
class Subset:
    """The conditions a sample must meet to be taken (None: that condition is not asked)."""

    seed: int
    subsample: float | None = None
    keys: frozenset[str] | None = None
    exclude: bool = False
    select: Select | None = None

    def __post_init__(self) -> None:
        if self.subsample is not None and not 0 < self.subsample <= 1:
            raise ValueError(f"subsample={self.subsample!r}: a fraction in (0, 1]")
        if self.exclude and self.keys is None:
            raise ValueError("exclude=True drops the samples named by keys=: give keys")
        if self.select is not None and not callable(self.select):
            raise ValueError("select: a function (key, members) -> bool")

    def keeps(self, key: str, members: Mapping[str, Any]) -> bool:
        if self.subsample is not None and _unit(self.seed, key) >= self.subsample:
            return False
        if self.keys is not None and (key in self.keys) == self.exclude:
            return False
        return self.select is None or bool(self.select(key, members))

    def apply(self, enc: EncodedBatch) -> int:
        """Drop from `enc` the samples not taken; how many were dropped."""
        dropped = 0
        for i in reversed(range(len(enc))):
            members = {"cls": enc.labels[i], **{e: col[i] for e, col in enc.extras.items()}}
            if not self.keeps(enc.keys[i], members):
                enc.drop(i)
                dropped += 1
        return dropped

    def describe(self) -> dict[str, Any]:
        """What a loader state records of it, to refuse a resume with another subset."""
        keys = None
        if self.keys is not None:
            digest = hashlib.blake2b("\n".join(sorted(self.keys)).encode("utf-8",
                                     "surrogateescape"), digest_size=8).hexdigest()
            keys = {"count": len(self.keys), "blake2b": digest, "exclude": self.exclude}
        select = _name_of(self.select) if self.select is not None else None
        return {"subsample": self.subsample, "keys": keys, "select": select}


def _name_of(fn: Any) -> str:
    """A predicate as a state records it: by its module and name (a lambda is `<lambda>`, so
    two lambdas compare equal: name the function to have a resume check it), never a repr
    with an address, which would differ in every process."""
    import functools

    if isinstance(fn, functools.partial):
        return f"partial({_name_of(fn.func)})"
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def subset_of(seed: int, subsample: float | None, keys: str | Path | Iterable[str] | None,
              exclude: bool, select: Select | None) -> Subset | None:
    """The loader options as a Subset (None when none of them is given). `keys`: a list of
    keys, or a text file of them (one a line; blank lines and `#` comments ignored)."""
    if subsample is None and keys is None and select is None and not exclude:
        return None
    return Subset(seed, subsample, _keys(keys) if keys is not None else None, exclude, select)


def _keys(keys: str | Path | Iterable[str]) -> frozenset[str]:
    if isinstance(keys, (str, Path)):
        lines = Path(keys).read_text(encoding="utf-8").splitlines()
        return frozenset(k.strip() for k in lines if k.strip() and not k.startswith("#"))
    found = frozenset(keys)
    if not all(isinstance(k, str) for k in found):
        raise ValueError("keys: strings (the samples' keys), or the path of a file of them")
    return found


def _unit(seed: int, key: str) -> float:
    """A uniform draw in [0, 1) from (seed, key): the same everywhere, never Python's salted
    hash()."""
    data = f"{seed}\x00{key}".encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") / 2**64
