"""An index folder: DALI's `.idx` files and `manifest.json` for shards that lie elsewhere,
read-only or remote (``shardflow index` SRC --out DIR` writes one).

    DIR/manifest.json     SRC's shards by name: samples, bytes, sha256; modality, labels
    DIR/NAME.idx          the index of SRC's NAME.tar

A loader given `index=DIR`, and `verify_shards --index DIR`, take the counts and checksums
from DIR's manifest and each shard's index from DIR: DALI's reader reads local shards through
those indexes, and the streaming reader splits ranks by the counts and fetches a resume's
samples by range. Shards are matched to the manifest by file name, so SRC may lie anywhere:

    source = a folder or URL prefix   -> every shard the manifest names, under it
    source = a pattern, URL or list   -> those shards, each of which the manifest must name
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import fsspec

from shardflow.shards import listing
from shardflow.shards.listing import list_shards
from shardflow.shards.manifest import MANIFEST, Manifest, ShardInfo, load_manifest
from shardflow.urls import beside, expand_braces, redact

SHARD_SUFFIXES = listing.SHARD_SUFFIXES


def index_path(url: str, index_dir: str | None) -> str:
    """Where the `.idx` of the shard at `url` lies: beside it, or in `index_dir` by name."""
    if index_dir is None:
        return beside(url, ".idx")
    return f"{index_dir.rstrip('/')}/{beside(shard_name(url), '.idx')}"


def load_index_manifest(index_dir: str, storage_options: Mapping[str, Any] | None = None
                        ) -> Manifest:
    """DIR's manifest; FileNotFoundError naming the command that writes one."""
    url = f"{index_dir.rstrip('/')}/{MANIFEST}"
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if not fs.isfile(path):
        raise FileNotFoundError(f"index={redact(index_dir)}: no {MANIFEST} there; write the "
                                "folder with `shardflow index SRC --out DIR`")
    return load_manifest(url, storage_options)


def matched(source: str | Sequence[str], index_dir: str,
            storage_options: Mapping[str, Any] | None = None
            ) -> tuple[list[tuple[str, ShardInfo]], Manifest]:
    """The shards of `source` with their manifest entries from `index_dir` (see the module's
    docstring); ValueError naming every listed shard the manifest does not know."""
    manifest = load_index_manifest(index_dir, storage_options)
    by_name = {s.name: s for s in manifest.shards}
    if isinstance(source, str) and _is_prefix(source):
        base = source.rstrip("/")
        return [(f"{base}/{s.name}", s) for s in manifest.shards], manifest
    urls = list_shards(source, storage_options) if isinstance(source, str) else \
        [u for item in source for u in expand_braces(str(item))]
    unknown = [u for u in urls if shard_name(u) not in by_name]
    if unknown:
        shown = ", ".join(redact(u) for u in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(f"index={redact(index_dir)}: its {MANIFEST} does not name {shown}{more}"
                         " (index those shards with `shardflow index` ... --out DIR)")
    return [(u, by_name[shard_name(u)]) for u in urls], manifest


def _is_prefix(source: str) -> bool:
    """A folder or URL prefix (the shards under it), not a shard, a glob or a brace pattern."""
    path = _path(source)
    return not path.endswith(SHARD_SUFFIXES) and not any(c in path for c in "*?[{")


def shard_name(url: str) -> str:
    """A shard's file name: what an index folder's manifest knows it by."""
    return _path(url).rsplit("/", 1)[-1]


def _path(url: str) -> str:
    """`url` without a query string (a signed URL's); a local path's "?" is a glob's."""
    return url.split("?", 1)[0] if "://" in url else url
