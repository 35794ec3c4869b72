"""Images: shards of .jpg/.png + .cls -> checks and crop windows -> DALI decode -> resize,
flip (normalize) -> `ImageBatch` on the device. See pipeline/README.md."""

from shardflow.image.config import ImageConfig
from shardflow.image.loader import ImageLoader, image_loader

__all__ = ["ImageConfig", "ImageLoader", "image_loader"]
