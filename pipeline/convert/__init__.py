"""make_shards' job: sources -> checked samples -> shards (see pipeline/README.md)."""

from pipeline.convert.config import ConvertConfig
from pipeline.convert.job import convert

__all__ = ["ConvertConfig", "convert"]
