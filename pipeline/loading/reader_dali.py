"""Local shards read by DALI's own `fn.readers.webdataset`, through the `.idx` files.

One small reader pipeline per epoch (the rank's shards in this epoch's order, DALI's bounded
shuffle buffer seeded from (seed, epoch, rank)); it yields encoded bytes, the `.cls` member and
each sample's source (`shard:offset:member`), which gives the key. DALI's own checkpointing
records the position: the state after each batch is `pipe.checkpoint()` at that batch.
"""

from __future__ import annotations

import base64
import os
import tarfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from pipeline.errors import DataError
from pipeline.loading.batch import EncodedBatch
from pipeline.loading.readplan import EpochPlan
from pipeline.shards.daliindex import parse_index
from pipeline.shards.tarread import split_name


def check_local_shard(url: str) -> int:
    """Samples in a local shard per its index, after checking that the tar holds every byte
    the index points at (a truncated shard is refused up front, not mid-epoch)."""
    idx = url[: -len(".tar")] + ".idx"
    if not os.path.isfile(idx):
        raise DataError("missing-index", "no .idx beside the shard; make it with "
                        "tools/make_shards.py shards, or read through the streaming reader",
                        source=url)
    with open(idx) as f:
        try:
            samples = parse_index(f.read())
        except (ValueError, UnicodeDecodeError) as exc:
            raise DataError("bad-index", f"{idx}: {exc}", source=url) from None
    end = max((off + size for s in samples for _, off, size, _ in s), default=0)
    if os.path.getsize(url) < end:
        raise DataError("truncated", f"the shard has {os.path.getsize(url)} bytes but its index "
                        f"points up to byte {end}", source=url)
    members = [m for s in samples for m in s]
    if members:
        _check_headers(url, [members[0], members[-1]])
    return len(samples)


def _check_headers(url: str, members: list[tuple[str, int, int, str]]) -> None:
    """The tar header before these members' data says what the index says: a shard replaced
    by another file (an error page, another shard) with its old .idx left beside it would
    otherwise be read as members at stale offsets, text decoding as documents."""
    with open(url, "rb") as f:
        for _ext, offset, size, name in members:
            f.seek(max(offset - 512, 0))
            try:
                info = tarfile.TarInfo.frombuf(f.read(512), "utf-8", "surrogateescape")
            except tarfile.HeaderError:
                info = None
            # A name that is not short ASCII lives in a PAX or GNU long-name record ahead
            # of this header, which holds a cut or transliterated copy: compare only sizes.
            short = name.isascii() and len(name) < 100
            if offset < 512 or info is None or info.size != size or \
                    (short and info.name != name):
                raise DataError("index-mismatch", f"the shard's bytes do not match its .idx at "
                                f"member {name!r} (offset {offset}): the shard was changed or "
                                "replaced after indexing", source=url)


def _seed(plan: EpochPlan) -> int:
    return (plan.seed * 1_000_003 + plan.epoch * 7919 + plan.rank) % (2**31 - 1)


def _build(plan: EpochPlan, checkpoint: bytes | None, exts: tuple[str, ...]) -> Any:
    from nvidia.dali import fn, pipeline_def

    paths = [s.url for s in plan.shards]
    shuffle = plan.shuffle_buffer > 1

    @pipeline_def(batch_size=plan.batch_size, num_threads=1, device_id=None, seed=_seed(plan),
                  enable_checkpointing=True, prefetch_queue_depth=2)
    def reader() -> Any:
        data, label = fn.readers.webdataset(
            paths=paths, index_paths=[p[: -len(".tar")] + ".idx" for p in paths],
            ext=[";".join(exts), "cls"], missing_component_behavior="empty",
            random_shuffle=shuffle, initial_fill=max(plan.shuffle_buffer, 1),
            pad_last_batch=True, name="reader")
        # A sample without the data member has no source there: take the label's.
        return (data, label, fn.get_property(data, key="source_info"),
                fn.get_property(label, key="source_info"))

    pipe = reader(checkpoint=checkpoint) if checkpoint else reader()
    pipe.build()
    return pipe


def batches(plan: EpochPlan, state: dict[str, Any] | None, exts: tuple[str, ...]
            ) -> Iterator[EncodedBatch]:
    """This rank's encoded batches for the epoch, from `state` on (None: from the start):
    each sample's first member among `exts` (empty when it has none) and its `.cls`."""
    if plan.length is None:
        raise ValueError("DALI's reader needs sample counts (manifest.json or .idx files)")
    length, emitted = plan.length, int(state["emitted"]) if state else 0
    pipe = _build(plan, _unpack(state["checkpoint"]) if state else None, exts)
    try:
        while emitted < length:
            data, labels, info, label_info = pipe.run()
            take = min(plan.batch_size, length - emitted)  # the rest is padding
            emitted += take
            state = {"emitted": emitted, "checkpoint": _pack(pipe.checkpoint())}
            yield _encoded(data, labels, (info, label_info), take, state)
    finally:
        del pipe  # DALI frees the pipeline's threads and buffers with the object


def _pack(checkpoint: bytes) -> str:
    """DALI's checkpoint (serialized bytes) as text, so that the loader state stays JSON."""
    return base64.b64encode(checkpoint).decode("ascii")


def _unpack(text: str) -> bytes:
    return base64.b64decode(text)


def _encoded(data: Any, labels: Any, info: Any, take: int, state: dict[str, Any]
             ) -> EncodedBatch:
    batch = EncodedBatch([], [], [], [], state)
    for i in range(take):
        source = np.array(info[0][i]).tobytes().decode() or \
            np.array(info[1][i]).tobytes().decode()
        url, _offset, member = source.rsplit(":", 2) if source.count(":") >= 2 else \
            ("(unknown shard)", "", "(unknown key)")
        label = np.array(labels[i]).tobytes()
        batch.keys.append(split_name(member)[0])
        batch.urls.append(url)
        batch.data.append(np.array(data[i]))
        batch.labels.append(label if label else None)
    return batch
