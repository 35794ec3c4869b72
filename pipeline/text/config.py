"""The text loader's options: the shared loader options plus what token rows need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardflow.loading.options import LoaderOptions, choice, positive

Objective = Literal["mlm", "clm"]  # e.g. objective="mlm" for BERT-style masking
READ_DOCS = 256  # packed text's documents per read at least, unless docs_per_read says


@dataclass(frozen=True)
class TextConfig(LoaderOptions):
    """Options of `text_loader`; every field is also a keyword argument of it.
    `batch_size` is rows per batch (with packing=False also documents per read); `train=False`
    draws the same masks every pass."""

    seq_len: int = 256
    objective: Objective = "clm"
    packing: bool = True  # False: one document per row, truncated to seq_len, padded
    mask_prob: float = 0.15
    # Packed text: documents the reader hands over at once, None: the larger of batch_size and
    # READ_DOCS. Each read costs fixed work (DALI's run, its state, a snapshot); reads of
    # 256 documents took 16-20% less CPU than reads of 64 here. With packing=False a read is
    # a batch (batch_size documents, one a row), and this must stay None.
    docs_per_read: int | None = None
    # Longer documents are truncated. Memory: a read holds up to docs_per_read documents of
    # at most this many tokens (int32), and about prefetch + 2 reads are in flight (+ 2 more
    # with an HF tokenizer, text/tokenize.py): lower docs_per_read for corpora of huge ones.
    max_doc_bytes: int = 1024 * 1024
    # The token rows are padded with, for a tokenizer.json that has no pad token of its own
    # (GPT-2 style); None: its pad token, else its end-of-text / separator token.
    pad_token: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "seq_len", "max_doc_bytes")
        choice(self, "objective", ("mlm", "clm"))
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len}: need at least 2 tokens per row")
        if not 0 < self.mask_prob < 1:
            raise ValueError(f"mask_prob={self.mask_prob}: a share in (0, 1)")
        if self.docs_per_read is not None:
            positive(self, "docs_per_read")
            if not self.packing:
                raise ValueError(f"docs_per_read={self.docs_per_read}: with packing=False a "
                                 "read is one batch of batch_size documents; leave it unset")

    def read_size(self) -> int:
        """Documents per read (see docs_per_read)."""
        if not self.packing:
            return self.batch_size
        return self.docs_per_read or max(self.batch_size, READ_DOCS)
