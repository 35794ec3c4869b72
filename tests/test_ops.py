"""shardflow.ops: each colour op against PIL's ImageEnhance/ImageOps (what torchvision's ops
on PIL images call) on photo-like JPEGs, for fixed parameters, within the stated levels;
batched application equal to one image at a time; draws from each sample's key alone;
MixUp and CutMix as the stated combination of two images of the batch, their targets by
lambda."""

from __future__ import annotations

import colorsys
import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import chi_square, on_the_device_path, photo_tensor
from PIL import Image, ImageEnhance, ImageOps

from shardflow import ops


def _diff(op: ops.Op, param: object, photos: list[Image.Image], reference) -> torch.Tensor:
    got = op.torch(photo_tensor(photos), [param] * len(photos))
    return (got.int() - photo_tensor([reference(p) for p in photos]).int()).abs()


# PIL rounds the grey level (fixed point, +0.5) and the mean it blends with; torchvision's
# definitions truncate: one level apart at most. The others are the same integer arithmetic.
@pytest.mark.parametrize("op, param, reference, levels", [
    (ops.Brightness(0.3), 0.3, lambda p: ImageEnhance.Brightness(p).enhance(0.3), 0),
    (ops.Brightness(1.7), 1.7, lambda p: ImageEnhance.Brightness(p).enhance(1.7), 0),
    (ops.Contrast(0.3), 0.3, lambda p: ImageEnhance.Contrast(p).enhance(0.3), 1),
    (ops.Contrast(1.7), 1.7, lambda p: ImageEnhance.Contrast(p).enhance(1.7), 1),
    (ops.Saturation(0.3), 0.3, lambda p: ImageEnhance.Color(p).enhance(0.3), 1),
    (ops.Saturation(1.7), 1.7, lambda p: ImageEnhance.Color(p).enhance(1.7), 1),
    (ops.Grayscale(p=1.0), True, lambda p: p.convert("L").convert("RGB"), 1),
    (ops.Solarize(100, p=1.0), True, lambda p: ImageOps.solarize(p, 100), 0),
    (ops.Posterize(3, p=1.0), True, lambda p: ImageOps.posterize(p, 3), 0),
    (ops.AutoContrast(p=1.0), True, ImageOps.autocontrast, 1),
    (ops.Equalize(p=1.0), True, ImageOps.equalize, 0),
], ids=lambda v: repr(v) if isinstance(v, ops.Op) else "")
def test_each_colour_op_is_pils(photos, op, param, reference, levels):
    diff = _diff(op, param, photos, reference)
    assert diff.max() <= levels, (op, diff.max(), diff.float().mean())
    if levels:
        assert diff.float().mean() < 0.6  # off by one on some pixels, not a shifted image


def _pil_hue(image: Image.Image, h: float) -> Image.Image:
    """torchvision's adjust_hue on a PIL image: PIL's 8-bit HSV, hue shifted mod 256."""
    hue, sat, val = image.convert("HSV").split()
    shifted = (np.array(hue, dtype=np.uint8) + np.uint8(np.int32(h * 255) % 256)).astype(np.uint8)
    return Image.merge("HSV", (Image.fromarray(shifted, "L"), sat, val)).convert("RGB")


def _colorsys_hue(image: Image.Image, h: float) -> Image.Image:
    """The definition in floats, pixel by pixel (Python's colorsys)."""
    rgb = np.asarray(image, dtype=np.float64) / 255
    out = np.empty_like(rgb)
    for y, x in np.ndindex(rgb.shape[:2]):
        hh, s, v = colorsys.rgb_to_hsv(*rgb[y, x])
        out[y, x] = colorsys.hsv_to_rgb((hh + h) % 1.0, s, v)
    return Image.fromarray((out * (256 - 1e-3)).astype(np.uint8))


@pytest.mark.parametrize("h", [0.1, -0.3, 0.5])
def test_hue_is_the_float_definition_and_near_pils_8_bit_hsv(photos, h):
    small = [p.resize((32, 24)) for p in photos[:3]]
    assert _diff(ops.Hue(h), h, small, lambda p: _colorsys_hue(p, h)).max() <= 1
    # PIL's HSV holds hue and saturation in 8 bits: up to ~11 levels off at saturated edges
    diff = _diff(ops.Hue(h), h, photos, lambda p: _pil_hue(p, h))
    assert diff.float().mean() < 1.0 and diff.max() <= 16, (diff.max(), diff.float().mean())


def test_a_batch_is_each_image_on_its_own_and_draws_follow_the_key(photos):
    """Batched with per-image parameters = one image at a time; a sample's draws come from
    its key alone (another batch, another position: the same pixels)."""
    recipe = [ops.ColorJitter(0.4, 0.4, 0.4, 0.1), ops.Grayscale(0.3), ops.Solarize(128),
              ops.Posterize(4), ops.AutoContrast(), ops.Equalize()]
    images, keys = photo_tensor(photos), [f"k{i}" for i in range(len(photos))]
    batch = ops.apply(recipe, images, ops.sample_rngs(7, 2, keys))
    for i, key in enumerate(keys):
        alone = ops.apply(recipe, images[i:i + 1], ops.sample_rngs(7, 2, [key]))
        assert torch.equal(batch[i], alone[0]), key
    reversed_batch = ops.apply(recipe, images.flip(0), ops.sample_rngs(7, 2, keys[::-1]))
    assert torch.equal(reversed_batch.flip(0), batch)
    assert not torch.equal(ops.apply(recipe, images, ops.sample_rngs(7, 3, keys)), batch)


def test_colour_jitter_draws_torchvisions_ranges_in_a_drawn_order(photos):
    jitter = ops.ColorJitter(brightness=0.4, contrast=0.2, saturation=0.3, hue=0.1)
    rng = random.Random(0)
    draws = [jitter.draw(rng) for _ in range(4000)]
    assert all(sorted(order) == [0, 1, 2, 3] for order, _ in draws)
    for kind, (lo, hi) in enumerate([(0.6, 1.4), (0.8, 1.2), (0.7, 1.3), (-0.1, 0.1)]):
        values = [factors[kind] for _, factors in draws]
        assert lo <= min(values) and max(values) <= hi
        assert np.mean(values) == pytest.approx((lo + hi) / 2, abs=0.02 * (hi - lo))
    firsts = np.bincount([order[0] for order, _ in draws], minlength=4)
    assert all(abs(f - 1000) < 120 for f in firsts), firsts  # each op first a quarter of the time
    # applied in the drawn order: the same as calling the four functions in that order
    image = photo_tensor(photos[:1])
    order, factors = draws[0]
    expected = image
    for kind in order:
        fn = (ops.color.brightness, ops.color.contrast, ops.color.saturation, ops.color.hue)[kind]
        expected = fn(expected, torch.tensor(factors[kind]).view(1, 1, 1, 1))
    assert torch.equal(jitter.torch(image, [draws[0]]), expected)


def test_an_op_with_p_changes_about_p_of_the_samples_and_leaves_the_rest(photos):
    images = photo_tensor(photos * 50)  # 300
    solarize = ops.Solarize(0, p=0.5)  # threshold 0: every value of a chosen image inverted
    params = [solarize.draw(rng) for rng in ops.sample_rngs(0, 0, map(str, range(300)))]
    out = solarize.torch(images, params)
    changed = [i for i in range(300) if not torch.equal(out[i], images[i])]
    assert changed == [i for i, p in enumerate(params) if p is not None]
    assert 120 < len(changed) < 180
    assert torch.equal(out[changed], 255 - images[changed])


def test_ops_refuse_what_is_not_a_uint8_batch():
    with pytest.raises(ValueError, match=r"Solarize.*uint8 images \(N, 1 or 3, H, W\)"):
        ops.Solarize(p=1.0).torch(torch.zeros(2, 3, 8, 8), [True, True])
    with pytest.raises(ValueError, match="hue=0.7"):
        ops.ColorJitter(hue=0.7)


# -- MixUp and CutMix ----------------------------------------------------------------------

def test_the_cpu_cast_to_uint8_truncates_as_torchs_cast():
    """base.to_uint8 goes through int32 on the CPU (torch's direct cast is slower there):
    the same levels as the direct cast for every value the ops hand it (0..255, halves,
    the ends), and the colour ops built on it give the same pixels as torch's maths."""
    values = torch.cat([torch.linspace(0, 255, 100_003), torch.tensor([0.0, 0.5, 254.999,
                                                                       255.0, -0.0])])
    assert torch.equal(ops.base.to_uint8(values), values.to(torch.uint8))
    images = torch.randint(0, 256, (3, 3, 17, 19), dtype=torch.uint8)
    f = torch.tensor([0.3, 1.0, 1.9]).view(-1, 1, 1, 1)
    r, g, b = images.unbind(1)
    grey = (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(1).to(torch.uint8)
    assert torch.equal(ops.color.grey(images), grey)
    want = (f * images.float() + (1.0 - f) * grey.float()).clamp(0, 255).to(torch.uint8)
    assert torch.equal(ops.color.saturation(images, f), want)


def test_mixup_is_the_stated_blend_of_two_images_and_of_their_targets(photos):
    images, labels = photo_tensor(photos), torch.tensor([0, 1, 2, 3, 4, 5])
    mix = ops.MixUp(0.8, classes=10, label_smoothing=0.1)
    out, targets, params = mix(images, labels, ops.batch_rng(0, 0, ["a", "b"]))
    lam = params.lam
    assert params.box is None and 0 < lam < 1
    expected = lam * images.float() + (1 - lam) * images.flip(0).float()
    assert (out.float() - expected).abs().max() <= 0.5  # rounded to the nearest level
    one_hot = torch.full((6, 10), 0.01).scatter_(1, labels.view(-1, 1), 0.91)
    assert torch.allclose(targets, lam * one_hot + (1 - lam) * one_hot.flip(0))
    assert torch.allclose(targets.sum(1), torch.ones(6))


def test_cutmix_pastes_a_box_of_the_flipped_batch_and_lambda_is_its_area(photos):
    images, labels = photo_tensor(photos), torch.arange(6)
    mix = ops.CutMix(1.0, classes=6, label_smoothing=0.0)
    for seed in range(20):
        out, targets, params = mix(images, labels, ops.batch_rng(seed, 0, ["x"]))
        y0, y1, x0, x1 = params.box
        inside = torch.zeros(72, 96, dtype=torch.bool)
        inside[y0:y1, x0:x1] = True
        assert torch.equal(out[..., inside], images.flip(0)[..., inside])
        assert torch.equal(out[..., ~inside], images[..., ~inside])
        assert params.lam == pytest.approx(1 - inside.sum().item() / (72 * 96))
        assert torch.allclose(targets.diagonal(), torch.full((6,), params.lam))
        assert torch.allclose(targets.flip(0).diagonal(), torch.full((6,), 1 - params.lam))


def test_mix_draws_follow_timm(photos):
    """Over 4000 batches: prob 0.6 of mixing, cutmix half of those (switch_prob 0.5);
    lambda ~ Beta(alpha, alpha): mean 1/2, variance 1 / (4 (2 alpha + 1))."""
    mix = ops.Mix(0.4, 1.0, classes=10, prob=0.6, switch_prob=0.5)
    rng = random.Random(1)
    draws = [mix.draw(rng, 224, 224) for _ in range(4000)]
    mixed = [d for d in draws if d.lam != 1.0]
    cut = [d for d in mixed if d.box is not None]
    assert len(mixed) / 4000 == pytest.approx(0.6, abs=0.04)
    assert len(cut) / len(mixed) == pytest.approx(0.5, abs=0.05)
    lams = np.array([d.lam for d in mixed if d.box is None])
    assert lams.mean() == pytest.approx(0.5, abs=0.03)
    assert lams.var() == pytest.approx(1 / (4 * (2 * 0.4 + 1)), rel=0.15)
    first = ops.batch_rng(3, 1, ["a", "b"]).random()
    assert first == ops.batch_rng(3, 1, ["a", "b"]).random()  # the batch's keys, in order
    assert first != ops.batch_rng(3, 1, ["b", "a"]).random()


# -- on a loader's batches (docs/ops.md's example) -------------------------------------------------

class Invert(ops.Op):
    """docs/ops.md's own op: the negative, for a share p of the images."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def draw(self, rng: random.Random) -> bool | None:
        return True if rng.random() < self.p else None

    def torch(self, images: torch.Tensor, params) -> torch.Tensor:
        chosen = ops.on_device([q is not None for q in params], images.device, torch.bool)
        return torch.where(chosen.view(-1, 1, 1, 1), 255 - images, images)


def _augmented(loader, batches, recipe, mix) -> list[tuple[list, torch.Tensor, torch.Tensor]]:
    """What docs/ops.md's loop trains on, batch by batch."""
    out = []
    for batch in batches:
        images = ops.apply(recipe, batch.image, ops.sample_rngs(0, loader.epoch, batch.keys))
        images, targets, _ = mix(images, batch.label, ops.batch_rng(0, loader.epoch, batch.keys))
        out.append((batch.keys, images, targets))
    return out


@pytest.mark.parametrize("reader, backend", [
    pytest.param("dali", "dali", marks=pytest.mark.dali), ("stream", "portable")])
@pytest.mark.backend
def test_augmented_and_mixed_batches_resume_bit_identical(op_shards, reader, backend):
    """Ops on a loader's batches, own op included, resumed mid-epoch after a state saved:
    the same keys, pixels and targets as the run that went on."""
    from shardflow import image_loader

    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    recipe = [ops.ColorJitter(0.4, 0.4, 0.4, 0.1), ops.Equalize(0.3), Invert(0.3)]
    mix = ops.Mix(0.8, 1.0, classes=10, label_smoothing=0.1)

    def make():  # type: ignore[no-untyped-def]
        return image_loader(op_shards, batch_size=8, size=32, device="cpu", seed=0, threads=1,
                            reader=reader, backend=backend, use_tuning=False)

    with make() as full:
        it = iter(full)
        head = _augmented(full, [next(it) for _ in range(2)], recipe, mix)
        state = json.loads(json.dumps(full.state_dict()))
        rest = _augmented(full, it, recipe, mix)
    with make() as resumed:
        resumed.load_state_dict(state)
        again = _augmented(resumed, resumed, recipe, mix)
    assert len(rest) == 3 and [k for k, _, _ in again] == [k for k, _, _ in rest]
    for (_, a, ta), (_, b, tb) in zip(again, rest, strict=True):
        assert torch.equal(a, b) and torch.equal(ta, tb)
    keys = [k for k, *_ in head + rest]
    assert len({k for ks in keys for k in ks}) == 40  # every sample once
    assert all(torch.allclose(t.sum(1), torch.ones(len(t))) for _, _, t in head + rest)


# -- geometry and policies ---------------------------------------------------------------------

def _affine_matrix(angle, translate, scale, shear, center) -> np.ndarray:
    """torchvision's F.affine as its docstring composes it, in pixels (y down): translate
    . centre . rotate (clockwise on screen) . scale . shear y . shear x . centre^-1, with
    SHx(s) = [[1, -tan s], [0, 1]] and SHy(s) = [[1, 0], [-tan s, 1]]: the map from input to
    output, 3 x 3, each factor written out (not shardflow's closed form)."""
    a, sx, sy = (math.radians(v) for v in (angle, *shear))

    def m(rows: list[list[float]]) -> np.ndarray:
        return np.array([*rows, [0.0, 0.0, 1.0]])

    centre = m([[1, 0, center[0]], [0, 1, center[1]]])
    return (m([[1, 0, translate[0]], [0, 1, translate[1]]]) @ centre
            @ m([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0]])
            @ m([[scale, 0, 0], [0, scale, 0]])
            @ m([[1, 0, 0], [-math.tan(sy), 1, 0]]) @ m([[1, -math.tan(sx), 0], [0, 1, 0]])
            @ np.linalg.inv(centre))


def _pil_affine(image: Image.Image, angle, translate, scale, shear, center=None) -> Image.Image:
    """torchvision's F.affine on a PIL image: PIL's Image.transform (output pixel centre ->
    input point, nearest neighbour) with the inverse of `_affine_matrix` about the centre."""
    w, h = image.size
    forward = _affine_matrix(angle, translate, scale, shear, center or (w * 0.5, h * 0.5))
    matrix = tuple(np.linalg.inv(forward)[:2].ravel())
    return image.transform(image.size, Image.AFFINE, matrix, Image.NEAREST)


def _pil_shear(image: Image.Image, x: float, y: float) -> Image.Image:
    """AutoAugment's shears as its authors wrote them (and timm's shear_x/shear_y): PIL's
    Image.transform with the inverse matrix (1, x, 0, y, 1, 0), about the top-left corner."""
    return image.transform(image.size, Image.AFFINE, (1, x, 0, y, 1, 0), Image.NEAREST)


def _share_differing(got: torch.Tensor, images: list[Image.Image]) -> float:
    return (got != photo_tensor(images)).any(1).float().mean().item()


@pytest.mark.parametrize("angle, tx, ty, scale, sx, sy", [
    (30.0, 0.0, 0.0, 1.0, 0.0, 0.0), (-17.0, 0.05, -0.04, 1.2, 10.0, 0.0),
    (0.0, 0.0, 0.0, 0.8, 0.0, 25.0), (12.0, -0.03, 0.06, 0.9, -7.0, 13.0)])
def test_affine_is_pils_transform(photos, angle, tx, ty, scale, sx, sy):
    """Nearest neighbour both: the same source pixel, but for ties at exactly half a pixel
    (measured: 0 to 0.03% of the pixels)."""
    got = ops.Affine().torch(photo_tensor(photos), [(angle, tx, ty, scale, sx, sy)] * len(photos))
    move = (float(round(tx * 96)), float(round(ty * 72)))
    want = [_pil_affine(p, angle, move, scale, (sx, sy)) for p in photos]
    assert _share_differing(got, want) < 0.002


def test_rotate_flip_and_sharpness_are_pils(photos):
    images = photo_tensor(photos)
    rotated = ops.Rotate(45).torch(images, [25.0] * len(photos))  # counter-clockwise
    assert _share_differing(rotated, [p.rotate(25.0, Image.NEAREST) for p in photos]) < 0.01
    flipped = ops.Flip(p=1.0).torch(images, [True] * len(photos))
    assert torch.equal(flipped, photo_tensor([ImageOps.mirror(p) for p in photos]))
    flipped = ops.Flip(p=1.0, vertical=True).torch(images, [True] * len(photos))
    assert torch.equal(flipped, photo_tensor([ImageOps.flip(p) for p in photos]))
    for f in (0.2, 1.8):
        diff = _diff(ops.Sharpness(f), f, photos,
                     lambda p, f=f: ImageEnhance.Sharpness(p).enhance(f))
        assert diff.max() <= 1 and diff.float().mean() < 0.1


@pytest.mark.parametrize("name, magnitude, reference", [
    # torchvision's _apply_op on PIL images: AutoAugment's shears, about the top-left corner
    ("ShearX", 0.3, lambda p: _pil_shear(p, 0.3, 0.0)),
    # (-0.2 would put a fifth of the columns on exact half-pixel ties, which the two break
    # apart by float rounding: 9% of the pixels)
    ("ShearY", -0.23, lambda p: _pil_shear(p, 0.0, -0.23)),
    ("TranslateX", 13.7, lambda p: _pil_affine(p, 0.0, (13.0, 0.0), 1.0, (0.0, 0.0))),
    ("TranslateY", -9.2, lambda p: _pil_affine(p, 0.0, (0.0, -9.0), 1.0, (0.0, 0.0))),
    ("Rotate", 20.0, lambda p: p.rotate(20.0, Image.NEAREST)),
    ("Posterize", 5.0, lambda p: ImageOps.posterize(p, 5)),
    ("Solarize", 170.0, lambda p: ImageOps.solarize(p, 170.0)),
    ("Brightness", 0.4, lambda p: ImageEnhance.Brightness(p).enhance(1.4)),
    ("Color", -0.6, lambda p: ImageEnhance.Color(p).enhance(0.4)),
    ("Equalize", 0.0, ImageOps.equalize),
])
def test_each_policy_op_is_torchvisions_on_pil(photos, name, magnitude, reference):
    from shardflow.ops.policies import run_op

    got = run_op(name, photo_tensor(photos), [magnitude] * len(photos))
    want = photo_tensor([reference(p) for p in photos])
    diff = (got.int() - want.int()).abs()
    # geometry: the same pixels but for half-pixel ties; colour: within one level
    assert (diff > 1).any(1).float().mean() < 0.01, name
    assert diff.float().mean() < 0.6, name


def test_randaugment_draws_follow_its_definition():
    """10,000 images x 2 ops: the 14 ops uniformly (chi-square, 13 degrees of freedom, below
    the 0.001 critical value 34.5), each at bin 9, the signed ones negated half the time."""
    from shardflow.ops.policies import RAND_AUGMENT

    policy = ops.RandAugment(num_ops=2, magnitude=9)
    steps = [s for rng in ops.sample_rngs(0, 0, map(str, range(10_000)))
             for s in policy.draw(rng)]
    names = list(RAND_AUGMENT)
    assert chi_square([sum(s[0] == n for s in steps) for n in names]) < 34.5
    signed = [s for s in steps if RAND_AUGMENT[s[0]][1]]
    assert {s[1] for s in signed} == {9}
    assert sum(s[2] for s in signed) / len(signed) == pytest.approx(0.5, abs=0.015)
    assert not any(s[2] for s in steps if not RAND_AUGMENT[s[0]][1])
    # the magnitudes at bin 9 of 31, torchvision's: 30 * 9/30 degrees, 0.9 * 9/30, 7 bits
    magnitude = {n: RAND_AUGMENT[n][0](9, 31, 224, 224) for n in ("Rotate", "Brightness",
                                                                   "Posterize", "TranslateX")}
    assert magnitude == pytest.approx({"Rotate": 9.0, "Brightness": 0.27, "Posterize": 7.0,
                                       "TranslateX": 150 / 331 * 224 * 9 / 30})


def test_trivial_augment_draws_follow_its_definition():
    """10,000 images: one op of 14 uniformly, its bin uniformly of 31 (chi-square, 30
    degrees of freedom, below the 0.001 critical value 59.7), signs half and half."""
    from shardflow.ops.policies import TRIVIAL_AUGMENT_WIDE as SPACE

    policy = ops.TrivialAugmentWide()
    steps = [policy.draw(rng)[0] for rng in ops.sample_rngs(1, 0, map(str, range(10_000)))]
    assert chi_square([sum(s[0] == n for s in steps) for n in SPACE]) < 34.5
    with_bins = [s for s in steps if SPACE[s[0]][0] is not None]
    assert chi_square([sum(s[1] == b for s in with_bins) for b in range(31)]) < 59.7
    signed = [s for s in with_bins if SPACE[s[0]][1]]
    assert sum(s[2] for s in signed) / len(signed) == pytest.approx(0.5, abs=0.02)
    assert SPACE["Rotate"][0](30, 31, 1, 1) == 135.0 and SPACE["Posterize"][0](30, 31, 1, 1) == 2


def test_policies_batched_are_each_image_on_its_own(photos):
    images, keys = photo_tensor(photos * 4), [f"p{i}" for i in range(24)]
    for policy in (ops.RandAugment(num_ops=3, magnitude=15), ops.TrivialAugmentWide()):
        batch = ops.apply([policy], images, ops.sample_rngs(5, 0, keys))
        for i in (0, 7, 23):
            alone = ops.apply([policy], images[i:i + 1], ops.sample_rngs(5, 0, [keys[i]]))
            assert torch.equal(batch[i], alone[0]), (policy, i)
        assert sum(not torch.equal(batch[i], images[i]) for i in range(24)) > 12


@pytest.mark.gpu
def test_ops_on_cuda_are_the_cpu_ops_and_never_wait_for_the_host(photos):
    """The same pixels on the GPU as on the CPU (nearest-neighbour geometry and integer
    colour: exact but for float rounding at level edges), and no host sync on the way:
    parameters cross through pinned memory (torch's sync debug mode raises on a sync)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here")
    recipe = [ops.RandAugment(num_ops=2, magnitude=15), ops.ColorJitter(0.4, 0.4, 0.4, 0.1),
              ops.Affine(15, (0.1, 0.1), (0.9, 1.1), (-8, 8)), ops.Flip(), ops.Equalize()]
    images, keys = photo_tensor(photos * 4), [f"g{i}" for i in range(24)]
    cpu = ops.apply(recipe, images, ops.sample_rngs(0, 0, keys))
    mix = ops.Mix(0.8, 1.0, classes=10)
    on_gpu = images.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = ops.apply(recipe, on_gpu, ops.sample_rngs(0, 0, keys))
        mixed, targets, _ = mix(gpu, torch.arange(24, device="cuda") % 10,
                                ops.batch_rng(0, 0, keys))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    diff = (gpu.cpu().int() - cpu.int()).abs()
    assert (diff > 1).float().mean() < 0.01 and targets.shape == (24, 10)
    assert mixed.device.type == "cuda"


@pytest.mark.parametrize("seed", range(3))
def test_ops_on_a_device_never_read_the_host_on_the_cpu_too(photos, seed):
    """The CPU twin of the test above: the same recipe and mixup on "meta" tensors take every
    branch a GPU takes, and make no host read and no copy from pageable memory (the GPU
    test's sync debug mode, counted here), over several draws."""
    recipe = [ops.RandAugment(num_ops=2, magnitude=15), ops.ColorJitter(0.4, 0.4, 0.4, 0.1),
              ops.Affine(15, (0.1, 0.1), (0.9, 1.1), (-8, 8)), ops.Flip(), ops.Equalize()]
    keys = [f"g{i}" for i in range(24)]
    mix = ops.Mix(0.8, 1.0, classes=10)

    def run(images: torch.Tensor, labels: torch.Tensor) -> None:
        out = ops.apply(recipe, images, ops.sample_rngs(seed, 0, keys))
        mixed, targets, _ = mix(out, labels, ops.batch_rng(seed, 0, keys))
        assert mixed.device.type == targets.device.type == "meta"
        assert mixed.shape == images.shape and targets.shape == (24, 10)

    assert on_the_device_path(run, photo_tensor(photos * 4), torch.arange(24) % 10) == []


def test_the_cpu_fast_paths_give_the_general_forms_pixels():
    """Lookup tables (brightness, contrast, solarize, autocontrast) and whole-pixel shifts
    (RandAugment's translations) are the float maths and the warp they replace, bit for
    bit, flat images and moves off the image included."""
    from shardflow.ops import color, geometry
    from shardflow.ops.policies import run_op

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (16, 3, 40, 50), dtype=torch.uint8, generator=gen)
    x[3] = 7  # one flat image
    f = torch.rand(16, 1, 1, 1, generator=gen) * 2

    def u8(t: torch.Tensor) -> torch.Tensor:
        return t.clamp(0, 255).to(torch.uint8)

    assert torch.equal(color.brightness(x, f), u8(x.float() * f))
    mean = color.grey(x).float().mean(dim=(1, 2, 3), keepdim=True)
    assert torch.equal(color.contrast(x, f), u8(f * x.float() + (1 - f) * mean))
    th = torch.rand(16, 1, 1, 1, generator=gen) * 255
    assert torch.equal(color.solarize(x, th), torch.where(x.float() >= th, 255 - x, x))
    lo, hi = (v.float() for v in (x.amin(dim=(2, 3), keepdim=True),
                                  x.amax(dim=(2, 3), keepdim=True)))
    scale = torch.where(hi <= lo, torch.ones_like(hi), 255.0 / (hi - lo).clamp(min=1))
    want = u8((x.float() - torch.where(hi <= lo, torch.zeros_like(lo), lo)) * scale)
    assert torch.equal(color.AutoContrast(p=1.0).fn(x), want)
    # a loader's batch is channels last (DALI's HWC): one table over each image's memory
    last = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    for fn in (lambda t: color.brightness(t, f), lambda t: color.contrast(t, f),
               lambda t: color.solarize(t, th), color.AutoContrast(p=1.0).fn,
               color.Equalize(p=1.0).fn):
        assert torch.equal(fn(last), fn(x))
    mags = [float(m) for m in torch.randint(-60, 60, (16,), generator=gen)]
    for name, move in (("TranslateX", lambda m: (float(int(m)), 0.0)),
                       ("TranslateY", lambda m: (0.0, float(int(m))))):
        warped = geometry.warp(x, [geometry.inverse_affine(0.0, move(m), 1.0, (0.0, 0.0))
                                   for m in mags])
        assert torch.equal(run_op(name, x, mags), warped), name


def test_a_cpu_batch_gets_the_same_pixels_in_any_chunk(photos, monkeypatch):
    """ops.apply takes a CPU batch CPU_CHUNK images at a time: the pixels do not depend on
    the chunk, the op's draws stay the sample's own."""
    from shardflow.ops import base

    images = torch.cat([photo_tensor(photos)] * 3)  # 18 images: chunks that do not divide it
    keys = [f"k{i}" for i in range(len(images))]
    recipe = [ops.RandAugment(2, 9), ops.ColorJitter(0.4, 0.4, 0.4, 0.1), ops.Equalize(0.5)]
    got = {}
    for chunk in (1, 4, 7, 64):
        monkeypatch.setattr(base, "CPU_CHUNK", chunk)
        got[chunk] = ops.apply(recipe, images, ops.sample_rngs(0, 0, keys))
    assert all(torch.equal(got[64], g) for g in got.values())
    assert not torch.equal(got[64], images)


def test_the_cpu_warp_is_the_device_warp(photos):
    """The CPU's own warp against the one a GPU runs (both run here on the CPU): the
    nearest-pixel gather against grid_sample, on photos (channels last, as a loader hands
    them), label maps and grey images, rotations, shears, scales and moves off the image."""
    from shardflow.ops import geometry

    gen = torch.Generator().manual_seed(3)
    images = photo_tensor(photos).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    rng = random.Random(3)
    mats = [geometry.inverse_affine(rng.uniform(-40, 40), (rng.uniform(-90, 90), 5.0),
                                    rng.uniform(0.6, 1.5), (rng.uniform(-20, 20), 0.0))
            for _ in images]
    masks = torch.randint(0, 3000, (len(images), 2, *images.shape[-2:]), dtype=torch.int32,
                          generator=gen)
    grey = torch.randint(0, 256, (len(images), 1, 31, 47), dtype=torch.uint8, generator=gen)
    for x in (images, masks, grey):
        fast, general = geometry._gather_warp(x, mats), geometry._grid_warp(x, mats)
        assert fast.dtype == x.dtype and fast.shape == x.shape
        apart = (fast != general).any(dim=1)
        assert apart.float().mean() < 1e-3  # float ties, a pixel in thousands at most
        assert (general == 0).all(dim=1).float().mean() > 0.05  # moves off the image: zeros
        assert torch.equal(fast[~apart.unsqueeze(1).expand_as(fast)],
                           general[~apart.unsqueeze(1).expand_as(general)])


def test_ops_take_an_empty_batch():
    """Every op, and the point ops, on a batch of no images: the shape comes back."""
    from shardflow.ops.crop import CenterCrop

    empty = torch.zeros((0, 3, 24, 24), dtype=torch.uint8)
    recipe = [ops.Flip(), ops.Affine(10), ops.Rotate(10), ops.ColorJitter(0.4, 0.4, 0.4, 0.1),
              ops.RandAugment(), ops.TrivialAugmentWide(), ops.AutoAugment(), ops.Equalize(),
              ops.GaussianBlur(3), ops.RandomErasing(), ops.Sharpness(0.5)]
    assert ops.apply(recipe, empty, []).shape == (0, 3, 24, 24)
    assert ops.Equalize(p=1.0).fn(empty).shape == (0, 3, 24, 24)
    images, masks = ops.apply(recipe, empty, [], masks=torch.zeros((0, 1, 24, 24)))
    assert images.shape == (0, 3, 24, 24) and masks.shape == (0, 1, 24, 24)
    assert ops.apply([CenterCrop(8)], torch.zeros((1, 3, 24, 24), dtype=torch.uint8),
                     ops.sample_rngs(0, 0, ["k"])).shape == (1, 3, 8, 8)
    clouds = torch.zeros((0, 16, 3))
    points = [ops.points.RotateZ(), ops.points.Scale(), ops.points.Jitter(),
              ops.points.Dropout()]
    assert ops.points.apply(points, clouds, []).shape == (0, 16, 3)
