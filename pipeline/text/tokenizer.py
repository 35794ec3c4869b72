"""Tokenizers for the text loader: a built-in byte-level one, and HF `tokenizers` files.

    load_tokenizer("bytes")                # no dependency: one id per UTF-8 byte + 3 specials
    load_tokenizer("out/tokenizer.json")   # HF tokenizers (pip install shardflow[text])

Both encode a list of documents at once (HF's Rust encoder spreads a batch over its own
threads) into int32 arrays, without special tokens: the packer adds the separators. Each names
its pad, separator and mask ids, and which ids are ordinary tokens (what masking may draw).
`describe()` identifies a tokenizer in loader states and checkpoints.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

# Special tokens looked up in an HF tokenizer, in order of preference.
PAD_NAMES = ("[PAD]", "<pad>", "<|pad|>")
SEP_NAMES = ("[SEP]", "</s>", "<|endoftext|>", "[EOS]", "<eos>")
MASK_NAMES = ("[MASK]", "<mask>")


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    sep_id: int  # ends every document in a packed row
    mask_id: int | None  # None: this tokenizer cannot do masked language modelling
    normal_ids: np.ndarray  # ids that are not special: what a random replacement draws from
    special_ids: tuple[int, ...]  # never chosen for masking

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Any) -> str: ...

    def describe(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """ids 0-255 are the UTF-8 bytes; 256 pad, 257 separator, 258 mask."""

    releases_gil = False  # numpy on small arrays: Python's work, in the loader's own thread

    vocab_size: int = 259
    pad_id: int = 256
    sep_id: int = 257
    mask_id: int | None = 258

    def __init__(self) -> None:
        self.normal_ids = np.arange(256, dtype=np.int32)
        self.special_ids: tuple[int, ...] = (self.pad_id, self.sep_id, 258)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32)
                for t in texts]

    def encode_packed(self, texts: list[str], sep_id: int) -> tuple[np.ndarray, np.ndarray]:
        """The documents back to back, each followed by `sep_id`: (tokens int32, starts
        int64), in a few numpy calls for all of them. Joined by NUL, which the loader's
        documents never hold (checked); texts that do go one by one."""
        data = np.frombuffer(("\0".join(texts) + "\0").encode("utf-8"), dtype=np.uint8)
        ends = np.flatnonzero(data == 0)
        if len(ends) != len(texts):  # a NUL inside a text: it is a byte like any other
            from shardflow.text.packing import join

            return join(self.encode_batch(texts), sep_id)
        tokens = data.astype(np.int32)
        tokens[ends] = sep_id
        return tokens, np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)

    def decode(self, ids: Any) -> str:
        data = bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"tokenizer": "bytes", "vocab_size": self.vocab_size}


class HFTokenizer:
    """A `tokenizer.json` of HF tokenizers; needs a separator token in its vocabulary. Rows
    are padded with `pad_token` when given, else its pad token, else (GPT-2 style files have
    none) the separator: padding is masked out of attention and labels, so its id only has
    to exist. Masked language modelling also needs a mask token (the text loader checks)."""

    def __init__(self, path: str | Path, pad_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise ImportError("HF tokenizers are an optional extra: pip install "
                              "'shardflow[text]' (or use tokenizer='bytes')") from None
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such tokenizer file (want a tokenizer.json "
                                    "made by tools/train_tokenizer.py or HF tokenizers)")
        data = path.read_bytes()
        try:
            self._tok = _HF.from_str(data.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception
            raise ValueError(f"{path}: not a tokenizers file ({exc})") from None
        self.sha256 = hashlib.sha256(data).hexdigest()
        _no_cutting(self._tok, path)
        self.vocab_size = self._tok.get_vocab_size()
        self.sep_id = self._special(path, SEP_NAMES, "separator")
        self.pad_id, self.pad_source = self._pad(path, pad_token)
        found = [self._tok.token_to_id(n) for n in MASK_NAMES]
        self.mask_id = next((i for i in found if i is not None), None)
        # Added tokens (pad, separator, mask, any other) are never drawn as random tokens.
        special = {int(i) for i in self._tok.get_added_tokens_decoder()}
        special |= {self.pad_id, self.sep_id} | ({self.mask_id} if self.mask_id is not None
                                                 else set())
        self.normal_ids = np.array([i for i in range(self.vocab_size) if i not in special],
                                   dtype=np.int32)
        self.special_ids: tuple[int, ...] = tuple(sorted(special))
        # "[SEP]" written in a document is text, not a separator: the data never makes
        # special tokens (no injected document boundaries or mask tokens).
        self._tok.encode_special_tokens = True

    def _special(self, path: Path, names: tuple[str, ...], what: str) -> int:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        raise ValueError(f"{path}: the tokenizer has no {what} token (looked for "
                         f"{', '.join(names)}); train one with tools/train_tokenizer.py")

    def _pad(self, path: Path, pad_token: str | None) -> tuple[int, str]:
        """(pad id, where it came from: "pad_token", "vocabulary" or "separator")."""
        if pad_token is not None:
            token_id = self._tok.token_to_id(pad_token)
            if token_id is None:
                raise ValueError(f"pad_token={pad_token!r}: {path} has no such token; name one "
                                 "of its tokens (e.g. its end-of-text token) or leave it unset")
            return int(token_id), "pad_token"
        found = [i for i in map(self._tok.token_to_id, PAD_NAMES) if i is not None]
        return (int(found[0]), "vocabulary") if found else (self.sep_id, "separator")

    releases_gil = True  # encode_batch runs in Rust threads, without the GIL

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Any) -> str:
        return str(self._tok.decode([int(i) for i in np.asarray(ids).ravel()]))

    def describe(self) -> dict[str, Any]:
        found = {"tokenizer": "hf", "vocab_size": self.vocab_size, "sha256": self.sha256}
        # The pad id only where it was chosen, so that states saved before it could be
        # chosen (files with a pad token) still match.
        return found if self.pad_source == "vocabulary" else {**found, "pad_id": self.pad_id}


def _no_cutting(tok: Any, path: Path) -> None:
    """Turn off the truncation and padding a tokenizer.json may carry (HF writes them with the
    file: a GPT-2 file saved with max_length=50 cut every document to 50 tokens, silently).
    Documents are packed or truncated into rows by the loader, never by the tokenizer."""
    found = []
    if tok.truncation is not None:
        found.append(f"truncation (max_length={tok.truncation.get('max_length')})")
        tok.no_truncation()
    if tok.padding is not None:
        found.append(f"padding (length={tok.padding.get('length')})")
        tok.no_padding()
    if found:
        log.warning("%s: the tokenizer file turns on %s; turned off, so that no document is "
                    "cut or padded by the tokenizer (the loader makes the rows)", path,
                    " and ".join(found))


def load_tokenizer(spec: str | Path | Tokenizer, pad_token: str | None = None) -> Tokenizer:
    """'bytes', a path to a tokenizer.json (padded with `pad_token` when given, see
    HFTokenizer), or a tokenizer object (returned as is)."""
    if pad_token is not None and not (isinstance(spec, (str, Path)) and str(spec) != "bytes"):
        raise ValueError(f"pad_token={pad_token!r} applies to a tokenizer.json; the byte "
                         "tokenizer and tokenizer objects bring their own pad id")
    if isinstance(spec, (str, Path)):
        return ByteTokenizer() if str(spec) == "bytes" else HFTokenizer(spec, pad_token)
    for name in ("encode_batch", "pad_id", "sep_id", "vocab_size", "normal_ids", "special_ids",
                 "describe"):
        if not hasattr(spec, name):
            raise TypeError(f"tokenizer {spec!r} has no {name!r}: pass 'bytes', a "
                            "tokenizer.json path, or an object like ByteTokenizer")
    return spec


SPECIALS = ["[PAD]", "[SEP]", "[MASK]"]


def train_bpe(texts: Iterable[str], out: Path, vocab_size: int) -> None:
    """Train a byte-level BPE (exact round trip, no unknown tokens) with the special tokens
    the text loader looks for, and write its tokenizer.json atomically."""
    try:
        from tokenizers import Tokenizer as _HF
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ImportError("training a tokenizer needs HF tokenizers: pip install "
                          "'shardflow[text]'") from None
    from shardflow.atomic import write_atomic

    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least "
                         f"{256 + len(SPECIALS)} (the 256 bytes and the special tokens)")
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    write_atomic(out, tok.to_str().encode("utf-8"))


def byte_unigram_entropy(texts: Iterable[str]) -> float:
    """Nats per token of a corpus under the byte tokenizer's unigram distribution (one
    separator per document included): what a language model must beat to have learned
    anything beyond letter frequencies."""
    counts, docs = np.zeros(256, dtype=np.int64), 0
    for text in texts:
        counts += np.bincount(np.frombuffer(text.encode("utf-8"), np.uint8), minlength=256)
        docs += 1
    every = np.append(counts, docs).astype(np.float64)
    p = every[every > 0] / every.sum()
    return float(-(p * np.log(p)).sum())
