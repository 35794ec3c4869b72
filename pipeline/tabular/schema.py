"""What tabular shards hold, found before reading them: the schema (label, dense and
categorical columns), the row count and the block size, from manifest.json's `tabular`
section, or, for shards named without their manifest, from the first block of the first shard
(rows then unknown)."""

from __future__ import annotations

from dataclasses import dataclass

import fsspec

from shardflow.errors import DataError
from shardflow.loading.shardlist import Source
from shardflow.samples.tabular_block import BLOCK_EXT, TabularSchema, decode_block
from shardflow.shards.tarread import iter_samples
from shardflow.urls import redact


@dataclass(frozen=True)
class SourceInfo:
    schema: TabularSchema
    rows: int | None  # rows in all the shards (None: unknown)
    blocks: int | None  # blocks (samples) in all the shards
    rows_per_block: int  # as converted (the last block of a part, and blocks with bad rows
    # skipped, hold fewer)


def source_info(resolved: Source) -> SourceInfo:
    """The source's schema and counts: its manifest's `tabular` section (which
    resolve_source keeps with the Source), else the first block; ValueError when it holds
    another modality."""
    if resolved.modality not in (None, "tabular", "unknown"):
        raise ValueError(f"these shards hold {resolved.modality} (manifest.json's modality), "
                         "not tabular rows: convert tables with make_shards.py tabular")
    # None where the manifest has no tabular section (shards re-sharded by the `shards` kind),
    # or there is no manifest: the first block says the schema then.
    doc = resolved.tabular
    if doc is not None:
        return SourceInfo(TabularSchema.from_json(doc["schema"]), int(doc["rows"]),
                          int(doc["blocks"]), int(doc["rows_per_block"]))
    return _from_first_block(resolved)


def _from_first_block(resolved: Source) -> SourceInfo:
    if not resolved.shards:
        raise ValueError("no shards to read")
    spec = resolved.shards[0]
    with fsspec.open(spec.url, "rb", **spec.storage_options) as f:
        for sample in iter_samples(f, redact(spec.url)):
            if BLOCK_EXT in sample:
                block = decode_block(sample[BLOCK_EXT])  # type: ignore[arg-type]
                schema = TabularSchema("label", block.dense_names, block.cat_names)
                return SourceInfo(schema, None, resolved.total, max(block.rows, 1))
    raise DataError("no-blocks", f"no .{BLOCK_EXT} member in the first shard: not tabular "
                    "shards (make_shards.py tabular writes them)", source=spec.url)
