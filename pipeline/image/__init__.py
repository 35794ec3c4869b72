"""Images: shards of .jpg/.png + .cls -> checks and crop windows -> DALI decode -> resize,
flip (normalize) -> `ImageBatch` on the device. See pipeline/README.md."""

from pipeline.image.config import ImageConfig
from pipeline.image.loader import ImageLoader, image_loader

__all__ = ["ImageConfig", "ImageLoader", "image_loader"]
