"""What tabular shards hold, found before reading them: the schema (label, dense and
categorical columns), the row count and the block size, from manifest.json's `tabular`
section, or, for shards named without their manifest, from the first block of the first shard
(rows then unknown)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from shardflow.errors import DataError
from shardflow.loading.shardlist import Source
from shardflow.samples.tabular_block import BLOCK_EXT, TabularSchema, decode_block
from shardflow.shards.manifest import MANIFEST, load_manifest
from shardflow.shards.tarread import iter_samples
from shardflow.urls import redact


@dataclass(frozen=True)
class SourceInfo:
    schema: TabularSchema
    rows: int | None  # rows in all the shards (None: unknown)
    blocks: int | None  # blocks (samples) in all the shards
    rows_per_block: int  # as converted (the last block of a part, and blocks with bad rows
    # skipped, hold fewer)


def source_info(source: str | Path | Sequence[str], resolved: Source,
                storage_options: Mapping[str, Any] | None) -> SourceInfo:
    """The source's schema and counts; ValueError when it holds another modality."""
    if resolved.modality not in (None, "tabular", "unknown"):
        raise ValueError(f"these shards hold {resolved.modality} (manifest.json's modality), "
                         "not tabular rows: convert tables with make_shards.py tabular")
    doc = _manifest_section(source, storage_options or {})
    if doc is not None:
        return SourceInfo(TabularSchema.from_json(doc["schema"]), int(doc["rows"]),
                          int(doc["blocks"]), int(doc["rows_per_block"]))
    return _from_first_block(resolved)


def _manifest_section(source: str | Path | Sequence[str], options: Mapping[str, Any]
                      ) -> dict[str, Any] | None:
    """manifest.json's `tabular` section, where the source is a folder (or URL) with one."""
    if not isinstance(source, (str, Path)):
        return None
    base = str(source).rstrip("/")
    url = base if base.endswith(".json") else f"{base}/{MANIFEST}"
    fs, path = fsspec.core.url_to_fs(url, **options)
    if not fs.exists(path):
        return None
    # None where the manifest has no tabular section (shards re-sharded by the `shards` kind):
    # the first block says the schema then.
    return load_manifest(url, options).tabular


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
