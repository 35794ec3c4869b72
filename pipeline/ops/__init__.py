"""Augmentation ops you compose: each draws its parameters for one sample in Python, from the
sample's own generator (seed, epoch, key), and applies them batched in torch over uint8
images (N, C, H, W), on the CPU or on the device. See pipeline/ops/README.md.

    from pipeline import ops
    images = ops.apply([ops.ColorJitter(0.4, 0.4, 0.4, 0.1), ops.Solarize(128)], images,
                       ops.sample_rngs(seed, epoch, keys))
"""

from pipeline.ops.base import Op, apply, sample_rngs
from pipeline.ops.color import (
    AutoContrast,
    Brightness,
    ColorJitter,
    Contrast,
    Equalize,
    Grayscale,
    Hue,
    Posterize,
    Saturation,
    Solarize,
)
from pipeline.ops.geometry import Affine, Flip, Rotate, Sharpness
from pipeline.ops.mix import CutMix, Mix, MixUp, batch_rng, soft_targets
from pipeline.ops.policies import RandAugment, TrivialAugmentWide

__all__ = ["Affine", "AutoContrast", "Brightness", "ColorJitter", "Contrast", "CutMix",
           "Equalize", "Flip", "Grayscale", "Hue", "Mix", "MixUp", "Op", "Posterize",
           "RandAugment", "Rotate", "Saturation", "Sharpness", "Solarize", "TrivialAugmentWide",
           "apply", "batch_rng", "sample_rngs", "soft_targets"]
