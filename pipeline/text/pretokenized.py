"""Text stored as token ids: what `make_shards text --tokenizer` writes and the text loader reads.

    conversion: documents -> tokenizer.encode_batch -> KEY.tokens.u16 (or .u32) -> shards
                manifest.json "tokens": the tokenizer's identity, the member, its dtype
    loading:    KEY.tokens.u16 -> ids (no tokenizer run) -> the same packing and masking

A document's ids are stored without special tokens, as `encode_batch` gives them: the loader
adds the separators, so pre-tokenized shards give the batches that tokenizing the same
documents at load time gives. uint16 when every id fits (vocabularies up to 65,536), uint32
otherwise, little-endian, no header: a member is `np.frombuffer`'s, and a read's documents
become one array in a few numpy calls (`packed`), whatever their number.

The loader takes the tokenizer it is given only if it is the one that made the ids (`check`):
its pad, separator and mask ids and its vocabulary must be those of the ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardflow.errors import DataError
from shardflow.samples.checks import modality_of
from shardflow.shards.manifest import TokenForm

_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def form_of(tokenizer: Any) -> TokenForm:
    """How `tokenizer`'s ids are stored: the smallest dtype that holds every id."""
    who = identity(tokenizer.describe())
    dtype = "uint16" if who["vocab_size"] <= 1 << 16 else "uint32"
    return TokenForm(who["tokenizer"], who["vocab_size"], who["sha256"],
                     "tokens.u16" if dtype == "uint16" else "tokens.u32", dtype)


def identity(described: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies a tokenizer's ids in its `describe()`: kind, vocabulary, file hash (not
    the pad id, which the ids never hold)."""
    return {"tokenizer": str(described.get("tokenizer", "custom")),
            "vocab_size": int(described["vocab_size"]), "sha256": described.get("sha256")}


def check(form: TokenForm, tokenizer: Any, where: str) -> None:
    """Refuse a tokenizer other than the one that made the stored ids, naming both."""
    theirs = {"tokenizer": form.tokenizer, "vocab_size": form.vocab_size,
              "sha256": form.sha256}
    mine = identity(tokenizer.describe())
    if mine != theirs:
        raise ValueError(f"{where} holds token ids of another tokenizer: the shards were "
                         f"tokenized with {_name(theirs)}, this loader has {_name(mine)}. "
                         "Pass the tokenizer they were converted with (make_shards text "
                         "--tokenizer), or convert the text again with this one")


def _name(who: Mapping[str, Any]) -> str:
    sha = f", sha256 {str(who['sha256'])[:12]}..." if who.get("sha256") else ""
    return f"{who['tokenizer']!r} (vocab_size {who['vocab_size']}{sha})"


# -- conversion -------------------------------------------------------------------------------

def encode_samples(samples: list[Any], tokenizer: Any, form: TokenForm, source: str
                   ) -> list[Any]:
    """The text samples of a task with their `.txt` replaced by its ids (one encode_batch
    call for all of them); other samples and errors pass as they are. A document that gives
    no ids is refused, as an empty one is."""
    texts = [i for i, s in enumerate(samples) if isinstance(s, dict) and "txt" in s
             and modality_of({k for k in s if not k.startswith("__")}) == "text"]
    if not texts:
        return samples
    encoded = tokenizer.encode_batch([bytes(samples[i]["txt"]).decode("utf-8") for i in texts])
    out = list(samples)
    for i, ids in zip(texts, encoded, strict=True):
        sample = {k: v for k, v in samples[i].items() if k != "txt"}
        if not len(ids):
            out[i] = DataError("empty-text", "the document gives no tokens",
                               source=str(sample.get("__url__", source)),
                               key=str(sample["__key__"]))
            continue
        sample[form.member] = np.asarray(ids).astype(_DTYPES[form.dtype]).tobytes()
        out[i] = sample
    return out


# -- loading and verifying --------------------------------------------------------------------

def ids_of(data: bytes | np.ndarray, form: TokenForm) -> np.ndarray:
    """One member's ids (int32), checked: whole ids, at least one, each below the vocabulary."""
    raw = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data
    dtype = _DTYPES[form.dtype]
    if not len(raw):
        raise DataError("empty-text", f"no .{form.member} member, or an empty one")
    if len(raw) % dtype.itemsize:
        raise DataError("bad-tokens", f".{form.member} holds {len(raw)} bytes, not a whole "
                        f"number of {form.dtype} ids")
    ids = raw.view(dtype)
    if int(ids.max()) >= form.vocab_size:
        raise DataError("bad-tokens", f"token id {int(ids.max())} is not below the "
                        f"tokenizer's vocab_size {form.vocab_size}")
    return ids.astype(np.int32)


def packed(data: list[np.ndarray], form: TokenForm, sep_id: int,
           flat: tuple[np.ndarray, np.ndarray] | None = None
           ) -> tuple[np.ndarray, np.ndarray] | None:
    """A read's members (checked whole: a few numpy calls) as a Piece's (tokens, starts),
    each document followed by the separator; None when one of them is bad, so that the
    caller checks each alone (ids_of) and names it. `flat`: the same members as one buffer
    and their sizes (EncodedBatch.flat), which saves a call per member."""
    itemsize = _DTYPES[form.dtype].itemsize
    if flat is not None:
        buffer, sizes = flat
    else:
        sizes = np.fromiter((len(d) for d in data), np.int64, len(data))
    if not len(sizes) or (sizes == 0).any() or (sizes % itemsize).any():
        return None
    raw = buffer[: int(sizes.sum())] if flat is not None else np.concatenate(data)
    ids = raw.view(_DTYPES[form.dtype])
    if int(ids.max()) >= form.vocab_size:
        return None
    ends = np.cumsum(sizes // itemsize)
    tokens = np.insert(ids.astype(np.int32), ends, sep_id)
    starts = np.concatenate(([0], ends[:-1] + np.arange(1, len(ends))))
    return tokens, starts.astype(np.int64)
