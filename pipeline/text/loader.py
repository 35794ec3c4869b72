"""The text loader: shards of `.txt` documents -> checks -> tokenizer -> packed (or truncated)
rows of `seq_len` tokens -> masking ("mlm") or next-token labels ("clm") -> `TextBatch`.

    from shardflow import text_loader
    with text_loader("shards/text", batch_size=32, seq_len=256, objective="mlm") as loader:
        for batch in loader:
            ...  # batch.input_ids, batch.labels, batch.attention_mask: int64 (32, 256)

One background stage overlaps with the training step: it reads documents (`docs_per_read`
at a time), checks them (UTF-8, no NUL, not empty; longer than `max_doc_bytes`: truncated,
with a warning naming shard and key), tokenizes them a read at a time (tokenize.py: an HF
tokenizer in helper threads, reads ahead, as it releases the GIL), packs, masks and copies
the batch to the device; a read's batches go to the consumer together (prefetch.Burst). No
DALI operator tokenizes, so this is CPU work in the loader's queue (DALI's reader still reads
local indexed shards, ahead, in its own threads).

With packing (the default) a batch is always `batch_size` full rows, except the epoch's last;
how many batches an epoch has depends on the token count, so `len()` is unknown and ranks
under torch.distributed agree when to stop (see Loader): the longer ranks leave their last
tokens out, as the image loader evens out samples.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.errors import DataError, SkipLog, handle
from shardflow.loading import consumed, mix, readers, settled, tuning
from shardflow.loading.agreement import rank_agreement
from shardflow.loading.batch import EncodedBatch, TextBatch
from shardflow.loading.delivery import DeviceCopier
from shardflow.loading.loader import Loader, Produced
from shardflow.loading.options import check_names
from shardflow.loading.prefetch import Burst
from shardflow.loading.readplan import EpochPlan
from shardflow.loading.shardlist import Source
from shardflow.samples.checks import TEXT_EXTS, text_of
from shardflow.text import elastic as text_elastic
from shardflow.text import masking, packing, pretokenized, tokenize
from shardflow.text.config import Objective, TextConfig
from shardflow.text.tokenizer import Tokenizer, load_tokenizer
from shardflow.urls import redact

log = logging.getLogger(__name__)
# Batches of one read handed to the consumer at once, at most (prefetch.Burst): a queue entry
# is up to this many batches, so about (prefetch + 2) x BURST batches are in memory.
BURST = 4


def text_loader(source: str | Path | Sequence[str] | Source | mix.Mixture, *,
                batch_size: int, seq_len: int = 256, objective: Objective = "clm",
                tokenizer: str | Path | Tokenizer = "bytes",
                seed: int = 0, rank: int | None = None, world_size: int | None = None,
                tuning_file: Path | None = None, use_tuning: bool = True,
                **options: Any) -> TextLoader | mix.MixedLoader:
    """A resumable loader of token batches from text shards (see `TextConfig`).

    `tokenizer`: "bytes" (built in), a tokenizer.json path (HF tokenizers), or an object
    with the same methods. `source` may be a `Source` resolved already (resolve_source; e.g.
    a held-out part of one), or a mixture `[(source, weight), ...]` (pipeline/loading/mix.py;
    packed text needs its `epoch_batches`). `rank`/`world_size` default to
    torch.distributed's. A tuning file's reader and prefetch apply where left automatic
    (pipeline/loading/tuning.py); `loader.settled` records which.
    """
    check_names("text_loader", options, TextConfig)
    if mix.is_mixture(source) or "epoch_samples" in options:  # by weight; mix.py
        return mix.build_from(text_loader, mix.sources_of(source), {
            "batch_size": batch_size, "seq_len": seq_len, "objective": objective,
            "tokenizer": tokenizer, "seed": seed, "rank": rank, "world_size": world_size,
            "tuning_file": tuning_file, "use_tuning": use_tuning, **options})
    resolved, tuned = tuning.source_and_options("text", source, options, tuning_file,
                                                use_tuning)
    options, record = settled.settle(options, tuned, tuning_file, {})
    cfg = TextConfig(batch_size=batch_size, seq_len=seq_len, objective=objective, seed=seed,
                     **options)
    rank, world_size = readers.distributed(rank, world_size)
    loader = TextLoader(resolved, cfg, load_tokenizer(tokenizer, cfg.pad_token), rank,
                        world_size)
    loader.settled = record
    return loader


class TextLoader(Loader):
    """Batches of token rows on the target device. Build with `text_loader(...)`."""

    kind = "text"

    def __init__(self, source: Source, cfg: TextConfig, tokenizer: Tokenizer, rank: int,
                 world_size: int) -> None:

        if cfg.objective == "mlm" and tokenizer.mask_id is None:
            raise ValueError("objective='mlm' needs a mask token; this tokenizer has none "
                             "(train one with tools/train_tokenizer.py, or use 'bytes')")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.read_docs = cfg.read_size()
        # Tokenizing, packing and masking run on the CPU; batches land on `device`.
        self._init_from_config(source, cfg, rank, world_size)
        # Shards of token ids (make_shards text --tokenizer) are read as ids, without running
        # the tokenizer, which must be the one that made them (text/pretokenized.py).
        self.tokens = source.tokens
        if self.tokens is not None:
            pretokenized.check(self.tokens, tokenizer, source.describe())
        cuda = self.placement.target == "cuda"
        self.copier = DeviceCopier(("cuda", self.cuda_index) if cuda else "cpu", None, None,
                                   True, slots=cfg.prefetch + 2)
        # Documents cut to max_doc_bytes so far, each logged; counted as read (read-ahead and a
        # resume's re-read included), so a figure to watch, not an exact count.
        self.truncated_docs = 0
        if cfg.packing:
            self.agree_to_stop = rank_agreement(world_size)
        self._draws = masking.MaskDraws()  # used in the stage thread only, one pass at a time

    def _plan_args(self, epoch: int) -> dict[str, Any]:
        # A plan's batches are the reader's reads: of docs_per_read documents (config.py).
        return {**super()._plan_args(epoch), "batch_size": self.read_docs}

    def _batches_per_epoch(self, plan: EpochPlan) -> int | None:
        # Packed: as many as the epoch's tokens fill, unknown until read. The plan's count
        # is of reads (docs_per_read documents each), not of batches.
        return None if self.cfg.packing else plan.batches

    def __len__(self) -> int:
        if self.cfg.packing:
            raise TypeError("a packed text loader's length depends on how many tokens the "
                            "documents hold; count batches in a pass, or use packing=False")
        return super().__len__()

    # -- state: what must match besides the shards ---------------------------------------------

    def _text_fields(self) -> dict[str, Any]:
        c = self.cfg
        return {"seq_len": c.seq_len, "objective": c.objective, "packing": c.packing,
                "mask_prob": c.mask_prob, "max_doc_bytes": c.max_doc_bytes,
                "docs_per_read": self.read_docs, **self.tokenizer.describe()}

    def _local_state(self) -> dict[str, Any]:
        return {**super()._local_state(), "text": self._text_fields()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theirs = state.get("text") or {}
        read_docs = self._read_docs_for(theirs)
        # States saved before reads could be larger than a batch read batch_size at a time.
        theirs = {**theirs, "docs_per_read": theirs.get("docs_per_read", self.cfg.batch_size)}
        mine = {**self._text_fields(), "docs_per_read": read_docs}
        for name, value in mine.items():
            if theirs.get(name) != value:
                raise ValueError(f"loader state does not match this loader; it differs in "
                                 f"{name}: {theirs.get(name)!r} in the state, {value!r} here. "
                                 "Build the loader as it was when the state was saved")
        before, self.read_docs = self.read_docs, read_docs
        try:
            super().load_state_dict(state)
        except Exception:
            self.read_docs = before
            raise

    def _read_docs_for(self, theirs: dict[str, Any]) -> int:
        """Documents per read to go on with from a state's text fields: this loader's, or,
        with docs_per_read left automatic, the batch_size reads of a state saved before reads
        could be larger (and of every state resumed from one since), so that they continue
        exactly."""
        saved = theirs.get("docs_per_read", self.cfg.batch_size)
        if self.cfg.docs_per_read is None and saved == self.cfg.batch_size:
            return self.cfg.batch_size
        return self.cfg.read_size()

    def _consumed_of(self, entry: dict[str, Any]) -> list[dict[str, Any] | None]:
        return text_elastic.consumed_of(entry.get("reader_state"))

    def _load_elsewhere(self, state: dict[str, Any]) -> None:
        old_rest = next((e.get("rest") for e in state["ranks"] if e.get("rest")), None)
        super()._load_elsewhere(state)
        if self._rest is not None:  # documents cut between batches start at their next token
            self._rest["offsets"] = text_elastic.offsets(state["ranks"], self._rest["epoch"],
                                                         old_rest)

    # -- the reader stage: documents -> tokens ---------------------------------------------------

    def _reads(self, plan: EpochPlan, before: dict[str, Any] | None, stop: threading.Event
               ) -> Generator[tuple[Any, dict[str, Any]], None, None]:
        """(tokenized read, reader state after it); `before` is where the reader starts."""
        ids = consumed.shard_index(plan)
        cut = {(int(i), k): int(t) for i, k, t in (self._rest or {}).get("offsets", [])} \
            if plan.rest else {}
        # A tokenizer that encodes outside the GIL (HF's, in Rust threads) works on the next
        # reads in a helper thread while this one packs and masks (tokenize.py).
        if self.tokens is not None:  # stored ids: numpy's work, in this thread
            encode = functools.partial(tokenize.stored, self.tokenizer.sep_id, cut=cut, ids=ids)
            depth = 0
        else:
            encode = functools.partial(tokenize.packed, self.tokenizer, cut=cut, ids=ids)
            depth = tokenize.AHEAD if tokenize.releases_gil(self.tokenizer) else 0
        tokenized = tokenize.mapped(encode, self._documents_of(plan, before, stop), depth)
        try:
            for (before, keys, skips, urls, read, after), (tokens, starts) in tokenized:
                yield (before, tokens, starts, keys, skips, urls, read), after
        finally:
            tokenized.close()  # its helper threads end here, not when it is collected

    def _documents_of(self, plan: EpochPlan, before: dict[str, Any] | None,
                      stop: threading.Event) -> Iterator[tuple[tuple[Any, ...], Any]]:
        """((state before the read, keys, skips, urls, samples read, state after), (texts,
        urls, keys)) per read: the documents of each read, checked, ready to tokenize."""
        exts = (self.tokens.member,) if self.tokens is not None else TEXT_EXTS
        # Stored ids are packed from the read's one buffer: no view a document (unpack).
        for enc in self._encoded(plan, before, exts, views=self.tokens is None):
            if stop.is_set():
                return
            # Every sample of the read, documents or not (text/elastic.py).
            read = list(zip(enc.urls, enc.keys, strict=True))
            read += [(s["source"], s["key"]) for s in enc.skips if s.get("key")]
            self._leave_out(enc)  # a split by key hash (holdout.py), a subset (subset.py)
            texts, keys, urls = self._documents(enc)
            yield (before, keys, enc.skips, urls, read, enc.state), (texts, urls, keys)
            before = enc.state

    def _documents(self, enc: EncodedBatch) -> tuple[Any, list[str], list[str]]:
        """(the read's documents, keys, urls): texts, or stored ids (a list of arrays, or
        the read already packed when every member of it is sound and within max_doc_bytes)."""
        longest = int(enc.flat[1].max(initial=0)) if enc.flat is not None else \
            max(map(len, enc.data), default=0)
        if self.tokens is not None and longest <= self.cfg.max_doc_bytes:
            whole = pretokenized.packed(enc.data, self.tokens, self.tokenizer.sep_id,
                                        enc.flat)
            if whole is not None:
                return whole, list(enc.keys), list(enc.urls)
        enc.unpack()
        docs, keys, urls, skips = [], [], [], SkipLog()
        for i in range(len(enc)):
            try:
                docs.append(self._document(enc.data[i], enc.urls[i], enc.keys[i]))
                keys.append(enc.keys[i])
                urls.append(enc.urls[i])
            except DataError as err:
                handle(err.located(source=enc.urls[i], key=enc.keys[i]), self.on_error, skips)
        enc.skips.extend(skips.entries)
        return docs, keys, urls

    def _document(self, raw: np.ndarray, url: str, key: str) -> str | np.ndarray:
        limit = self.cfg.max_doc_bytes
        if self.tokens is not None:  # stored ids: max_doc_bytes of them, in whole ids
            ids = pretokenized.ids_of(raw, self.tokens)
            if ids.nbytes > limit:
                keep = limit // (ids.nbytes // len(ids))
                log.warning("%s key %r: a document of %d stored token ids; only its first %d "
                            "are used (max_doc_bytes=%d)", redact(url), key, len(ids), keep,
                            limit)
                self.truncated_docs += 1
                ids = ids[:keep]
            return ids
        data = raw.tobytes()
        if len(data) > limit:
            cut = limit
            while cut and (data[cut] & 0xC0) == 0x80:  # not inside a UTF-8 character
                cut -= 1
            log.warning("%s key %r: a document of %d bytes; only its first %d are used "
                        "(max_doc_bytes=%d)", redact(url), key, len(data), cut, limit)
            self.truncated_docs += 1
            data = data[:cut]
        if not data:
            raise DataError("empty-text", "no .txt member, or an empty one")
        return text_of(data)

    # -- the text stage: pack, mask, to the device ------------------------------------------------

    def _produce(self, plan: EpochPlan, state: dict[str, Any] | None, stop: threading.Event
                 ) -> Iterator[Produced | Burst]:
        before = state["reader"] if state else None
        index = int(state["batches"]) if state else 0
        # Read, tokenize, pack and mask in this one thread, the loader's stage: DALI's reader
        # reads ahead in its own threads and HF tokenizers encodes on its own, both outside
        # the GIL. A second Python thread for the reads made an epoch 1.4-1.5x slower here: each
        # thread, back from numpy or DALI, waited for the other to give up the GIL.
        reads = self._reads(plan, before, stop)
        try:
            if self.cfg.packing:
                drop = int(state["offset"]) if state else 0
                yield from self._packed(plan, reads, drop, index, stop)
            else:
                yield from self._truncated(plan, reads, index, stop)
        finally:
            reads.close()

    def _packed(self, plan: EpochPlan, reads: Iterator[Any], drop: int, index: int,
                stop: threading.Event) -> Iterator[Produced | Burst]:
        packer: packing.Packer[packing.Piece] = packing.Packer(
            self.cfg.batch_size * self.cfg.seq_len)
        shards = consumed.shard_index(plan)
        for n, ((before, tokens, starts, keys, skips, urls, read), after) in enumerate(reads):
            piece = packing.Piece(before, tokens, starts, keys, skips, urls=urls, read=read)
            if n == 0 and drop:  # resuming inside this read: its first tokens went out
                piece.offset, piece.reported = drop, True
            packer.add(piece, after)
            burst = Burst()  # the batches of this read, handed over together (prefetch.py)
            while packer.ready() and not stop.is_set():
                item = self._emit(packing.tokens_of(*packer.take()), packer.position(),
                                  plan.epoch, index)
                item[1]["elastic"] = text_elastic.in_progress(packer, shards)
                burst.append(item)
                index += 1
                if len(burst) == BURST:
                    yield burst
                    burst = Burst()
            if burst:
                yield burst
        while packer.available or packer.pending_skips():  # the epoch's last, short batch
            cut = packing.tokens_of(*packer.take())
            ids, attention = packing.rows(cut.tokens, self.cfg.seq_len, self.tokenizer.pad_id)
            item = self._batch_or_skips(ids, attention, cut.keys, cut.skips, packer.position(),
                                        plan.epoch, index)
            item[1]["elastic"] = text_elastic.in_progress(packer, shards)
            yield item
            index += 1

    def _truncated(self, plan: EpochPlan, reads: Iterator[Any], index: int,
                   stop: threading.Event) -> Iterator[Produced]:
        c = self.cfg
        for (_before, tokens, starts, keys, skips, _urls, _read), after in reads:
            if stop.is_set():
                return
            docs = packing.documents(tokens, starts)
            ids, attention, _cut = packing.truncated_rows(docs, c.seq_len,
                                                          self.tokenizer.pad_id,
                                                          self.tokenizer.sep_id)
            # Every read is a batch, even one whose documents were all skipped (0 rows): the
            # epoch is len() batches on every rank, which step together (a trainer skips a
            # step some rank has no rows for, on every rank: trainers/run.py).
            item = self._batch(ids.reshape(-1, c.seq_len), attention.reshape(-1, c.seq_len),
                               keys, skips, (after, 0), plan.epoch, index)
            index += 1
            yield item

    def _emit(self, cut: packing.Cut, position: tuple[dict[str, Any] | None, int],
              epoch: int, index: int) -> Produced:
        ids, attention = packing.rows(cut.tokens, self.cfg.seq_len, self.tokenizer.pad_id)
        return self._batch(ids, attention, cut.keys, cut.skips, position, epoch, index)

    def _batch_or_skips(self, ids: np.ndarray, attention: np.ndarray, keys: list[str],
                        skips: list[dict[str, str]], position: tuple[dict[str, Any] | None, int],
                        epoch: int, index: int) -> Produced:
        """A batch, or with no rows (every document of it skipped) an item that only carries
        the skips: a batch of 0 rows would be a step one rank skips and the others take."""
        if not len(ids):
            state = {"reader": position[0], "offset": position[1], "batches": index}
            return None, state, None, skips
        return self._batch(ids, attention, keys, skips, position, epoch, index)

    def _batch(self, ids: np.ndarray, attention: np.ndarray, keys: list[str],
               skips: list[dict[str, str]], position: tuple[dict[str, Any] | None, int],
               epoch: int, index: int) -> Produced:
        import torch

        inputs, labels = self._labels(ids, attention, epoch, index)
        (inputs_t, labels_t, attention_t), ready = self.copier.move(
            torch.from_numpy(inputs), torch.from_numpy(labels), torch.from_numpy(attention))
        state = {"reader": position[0], "offset": position[1], "batches": index + 1}
        return TextBatch(inputs_t, labels_t, attention_t, keys), state, ready, skips

    def _labels(self, ids: np.ndarray, attention: np.ndarray, epoch: int, index: int
                ) -> tuple[np.ndarray, np.ndarray]:
        if self.cfg.objective == "clm":
            return ids, masking.clm(ids, attention)
        tok = self.tokenizer
        # Evaluation draws the same masks every pass, so that its losses compare.
        rng = self._draws.batch(self.seed, epoch if self.cfg.train else 0, self.rank, index)
        assert tok.mask_id is not None
        return masking.mlm(ids, attention, rng, mask_id=tok.mask_id, normal_ids=tok.normal_ids,
                           special_ids=tok.special_ids,
                           prob=self.cfg.mask_prob)

