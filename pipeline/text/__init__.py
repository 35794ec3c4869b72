"""Text: shards of .txt -> document checks -> tokenize -> pack rows -> mask (MLM) or shift
(CLM) -> `TextBatch` on the device. No DALI. See pipeline/README.md."""

from pipeline.text.config import TextConfig
from pipeline.text.loader import TextLoader, text_loader

__all__ = ["TextConfig", "TextLoader", "text_loader"]
