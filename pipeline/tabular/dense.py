"""Dense (numeric) features on the CPU: missing values filled, counts compressed, clipped.

    out = clip(transform(x))   for a present value
    out = fill                 for a missing one (NaN in the block), neither transformed nor
                               clipped: the value the model sees for "unknown"

transform: "log1p" is log(1 + max(x, 0)), the DLRM reference's treatment of Criteo's counts
(its few negative values become 0); "signed_log" is sign(x) log(1 + |x|), for features whose
sign means something; "none" leaves x as it is. Counts span many orders of magnitude: a model
sees them far better on a log scale.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

DenseTransform = Literal["log1p", "signed_log", "none"]  # e.g. dense_transform="signed_log"
TRANSFORMS = ("log1p", "signed_log", "none")


def transform(dense: np.ndarray, kind: DenseTransform, fill: float,
              clip: tuple[float, float] | None) -> np.ndarray:
    """float32 of dense's shape: the block's dense values as the model gets them."""
    x = np.array(dense, dtype=np.float32)  # a copy: the block's own array stays as read
    missing = np.isnan(x)
    if kind == "log1p":
        np.maximum(x, 0, out=x)
        np.log1p(x, out=x)
    elif kind == "signed_log":
        x = np.sign(x) * np.log1p(np.abs(x))
    if clip is not None:
        np.clip(x, clip[0], clip[1], out=x)
    x[missing] = fill
    return x
