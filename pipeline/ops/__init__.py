"""Augmentation ops you compose: each draws its parameters for one sample in Python, from the
sample's own generator (seed, epoch, key), and applies them batched in torch over uint8
images (N, C, H, W), on the CPU or on the device. See the `ops/` section of pipeline/README.md.

    from shardflow import ops
    images = ops.apply([ops.ColorJitter(0.4, 0.4, 0.4, 0.1), ops.Solarize(128)], images,
                       ops.sample_rngs(seed, epoch, keys))
"""

from shardflow.ops import points
from shardflow.ops.base import Op, apply, on_device, sample_rngs
from shardflow.ops.color import (
    AutoContrast,
    Brightness,
    ColorJitter,
    Contrast,
    Equalize,
    Grayscale,
    Hue,
    Normalize,
    Posterize,
    Saturation,
    Solarize,
)
from shardflow.ops.crop import CenterCrop, RandomResizedCrop, WindowOp
from shardflow.ops.erase import RandomErasing
from shardflow.ops.geometry import Affine, Flip, GaussianBlur, Rotate, Sharpness
from shardflow.ops.mix import CutMix, Mix, MixUp, batch_rng, soft_targets
from shardflow.ops.policies import AutoAugment, RandAugment, TrivialAugmentWide

__all__ = ["Affine", "AutoAugment", "AutoContrast", "Brightness", "CenterCrop", "ColorJitter",
           "Contrast", "CutMix", "Equalize", "Flip", "GaussianBlur", "Grayscale", "Hue", "Mix",
           "MixUp", "Normalize", "Op", "Posterize", "RandAugment", "RandomErasing",
           "RandomResizedCrop", "Rotate", "Saturation", "Sharpness", "Solarize",
           "TrivialAugmentWide", "WindowOp", "apply", "batch_rng", "on_device", "points",
           "sample_rngs", "soft_targets"]
