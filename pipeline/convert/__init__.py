"""make_shards' job: sources -> checked samples -> shards (see pipeline/README.md)."""

from shardflow.convert.config import ConvertConfig
from shardflow.convert.job import convert

__all__ = ["ConvertConfig", "convert"]
