"""Text: shards of .txt (or of stored token ids) -> document checks -> tokenize -> pack rows ->
mask (MLM) or shift (CLM) -> `TextBatch` on the device. No DALI. See pipeline/README.md."""

from typing import Any

__all__ = ["TextConfig", "TextLoader", "text_loader"]


def __getattr__(name: str) -> Any:
    # Lazy, as pipeline's own: make_shards' workers tokenize (pretokenized.py) without torch.
    if name == "TextConfig":
        from shardflow.text.config import TextConfig

        return TextConfig
    if name in ("TextLoader", "text_loader"):
        from shardflow.text import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'shardflow.text' has no attribute {name!r}")
