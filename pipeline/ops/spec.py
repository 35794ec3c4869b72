"""Augmentation recipes by name, as timm spells them on its command line:

    rand-m9-n2-mstd0.5   RandAugment: 2 ops at magnitude 9 of timm's 10 levels (bin 27 of
                         torchvision's 31), each op's level drawn from N(9, 0.5), clipped
    rand-m9              the same with n2 (timm's default), no noise
    trivial              TrivialAugmentWide
    original             AutoAugment("imagenet"): timm's name for the AutoAugment paper's
                         ImageNet policy, torchvision's AutoAugmentPolicy.IMAGENET (also
                         accepted as "autoaug"; timm's other policies, v0 and the "r"
                         variants, and its mstd noise on them are not built)

timm's levels run 0..10 (its _LEVEL_DENOM); the ops and their ranges here are
torchvision's, so a level L is bin L / 10 * 30. The same holds for "original": the 25
sub-policies are the paper's, as timm's and torchvision's, and each op's magnitude at its
bin is torchvision's (timm maps the paper's levels to its own ranges).
"""

from __future__ import annotations

import re

from shardflow.ops.base import Op
from shardflow.ops.policies import AutoAugment, RandAugment, TrivialAugmentWide

LEVELS = 10  # timm's magnitude scale
_RAND = re.compile(r"rand((?:-(?:m[\d.]+|n\d+|mstd[\d.]+))*)")


def parse(spec: str) -> list[Op]:
    """The ops of a recipe name; ValueError naming what is accepted for anything else."""
    if spec == "trivial":
        return [TrivialAugmentWide()]
    if spec in ("original", "autoaug"):
        return [AutoAugment("imagenet")]
    match = _RAND.fullmatch(spec)
    if match is None:
        raise ValueError(f"augment spec {spec!r}: use 'rand-m<level>[-n<ops>][-mstd<std>]' "
                         "(RandAugment, timm's spelling: rand-m9-n2-mstd0.5), 'trivial' or "
                         "'original' (AutoAugment's ImageNet policy)")
    options = {"m": 9.0, "n": 2.0, "mstd": 0.0}
    for part in filter(None, match[1].split("-")):
        name = re.match(r"mstd|m|n", part)[0]  # type: ignore[index]
        options[name] = float(part[len(name):])
    if not 0 <= options["m"] <= LEVELS:
        raise ValueError(f"augment spec {spec!r}: the level m must be in [0, {LEVELS}]")
    to_bin = 30 / LEVELS
    return [RandAugment(num_ops=int(options["n"]), magnitude=options["m"] * to_bin,
                        magnitude_std=options["mstd"] * to_bin)]
