"""shardflow.ops, the second set: AutoAugment (torchvision's tables and draws, batched as
each image alone), RandomErasing (the drawn box exactly, torchvision's get_params
distribution), GaussianBlur (torchvision's definition in numpy, within a level of PIL's
approximation) and Normalize (float out, last), against PIL and the definitions."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from conftest import chi_square, import_or_skip, on_the_device_path, photo_tensor
from PIL import ImageFilter, ImageOps

from shardflow import ops
from shardflow.ops.erase import erase_box, hashed_noise
from shardflow.ops.policies import AUTO_AUGMENT, AUTO_AUGMENT_POLICIES, run_op


def _rngs(n: int, tag: str = "s") -> list[random.Random]:
    return ops.sample_rngs(0, 0, [f"{tag}{i}" for i in range(n)])


# -- AutoAugment ---------------------------------------------------------------------------

def test_autoaugment_tables_and_magnitudes_are_torchvisions():
    """25 sub-policies of two ops each per policy, every op in the space, a bin exactly for
    the ops with a magnitude; the 10-bin magnitudes of torchvision's _augmentation_space."""
    for table in AUTO_AUGMENT_POLICIES.values():
        assert len(table) == 25 and all(len(sub) == 2 for sub in table)
        for name, prob, bin_ in (op for sub in table for op in sub):
            assert 0 <= prob <= 1
            assert (bin_ is None) == (AUTO_AUGMENT[name][0] is None), name
            assert bin_ is None or 0 <= bin_ <= 9
    imagenet = AUTO_AUGMENT_POLICIES["imagenet"]
    assert imagenet[0] == (("Posterize", 0.4, 8), ("Rotate", 0.6, 9))
    assert imagenet[13] == (("Invert", 0.6, None), ("Equalize", 1.0, None))
    assert imagenet[24] == (("Equalize", 0.8, None), ("Equalize", 0.6, None))
    assert "Identity" not in AUTO_AUGMENT and AUTO_AUGMENT["Invert"] == (None, False)

    def at(name: str, b: int, h: int = 72, w: int = 96) -> float:
        return AUTO_AUGMENT[name][0](b, 10, h, w)

    # 8 - round(i / (9 / 4)), torch.round's half to even as Python's round
    assert [at("Posterize", b) for b in range(10)] == [8, 8, 7, 7, 6, 6, 5, 5, 4, 4]
    assert at("Rotate", 9) == 30.0 and at("Rotate", 3) == pytest.approx(10.0)
    assert at("Solarize", 5) == pytest.approx(255 * 4 / 9) and at("Solarize", 0) == 255.0
    assert at("Color", 0) == 0.0 and at("Color", 9) == pytest.approx(0.9)
    # image_size is (width, height): TranslateX goes with the width
    assert at("TranslateX", 9) == pytest.approx(150 / 331 * 96)
    assert at("TranslateY", 9) == pytest.approx(150 / 331 * 72)
    with pytest.raises(ValueError, match="policy='reduced'"):
        ops.AutoAugment("reduced")


def test_autoaugment_draws_follow_its_definition():
    """10,000 images: the 25 sub-policies uniformly (chi-square, 24 degrees of freedom, below
    the 0.001 critical value 51.2); each op applied with its probability (within 5 standard
    errors; never at 0.0, always at 1.0), at its own bin; the signed ones negated half the
    time, the others never."""
    policy = ops.AutoAugment("imagenet")
    table = AUTO_AUGMENT_POLICIES["imagenet"]
    draws = [policy.draw(rng) for rng in _rngs(10_000)]
    assert chi_square([sum(i == k for i, _ in draws) for k in range(25)]) < 51.2
    signs = []
    for k, sub in enumerate(table):
        steps = [s for i, s in draws if i == k]
        for pos, (name, prob, bin_) in enumerate(sub):
            applied = [s[pos] for s in steps if s[pos] is not None]
            share = len(applied) / len(steps)
            assert abs(share - prob) <= 5 * math.sqrt(prob * (1 - prob) / len(steps)), (k, pos)
            assert all(a[:2] == (name, bin_ or 0) for a in applied)
            if AUTO_AUGMENT[name][1]:
                signs += [a[2] for a in applied]
            else:
                assert not any(a[2] for a in applied)
    assert sum(signs) / len(signs) == pytest.approx(0.5, abs=0.03)


def test_invert_and_a_drawn_sub_policy_are_the_ops_in_order(photos):
    """Invert is PIL's ImageOps.invert; a sub-policy runs its applied ops in order at their
    signed magnitudes (bin 8 of Rotate negated: -26.7 degrees), skipping the others."""
    images = photo_tensor(photos)
    assert torch.equal(run_op("Invert", images, [0.0] * 6),
                       photo_tensor([ImageOps.invert(p) for p in photos]))
    policy = ops.AutoAugment("imagenet")
    params = [(13, [("Invert", 0, False), ("Equalize", 0, False)]),  # both applied
              (13, [None, ("Equalize", 0, False)]),
              (15, [("Rotate", 8, True), ("Color", 2, False)]),
              (15, [("Rotate", 8, False), None]),
              (2, [None, None]), (0, [("Posterize", 8, False), None])]
    got = policy.torch(images, params)
    equalize = ops.Equalize(p=1.0).fn
    rotate = 30 * 8 / 9
    want = [equalize(255 - images[:1]), equalize(images[1:2]),
            run_op("Color", run_op("Rotate", images[2:3], [-rotate]), [0.9 * 2 / 9]),
            run_op("Rotate", images[3:4], [rotate]), images[4:5], images[5:6] & 0xF0]
    for i, expected in enumerate(want):
        assert torch.equal(got[i], expected[0]), i


@pytest.mark.parametrize("policy", sorted(AUTO_AUGMENT_POLICIES))
def test_autoaugment_batched_is_each_image_on_its_own(photos, policy):
    images, keys = photo_tensor(photos * 4), [f"a{i}" for i in range(24)]
    augment = [ops.AutoAugment(policy)]
    batch = ops.apply(augment, images, ops.sample_rngs(3, 0, keys))
    for i in range(24):
        alone = ops.apply(augment, images[i:i + 1], ops.sample_rngs(3, 0, [keys[i]]))
        assert torch.equal(batch[i], alone[0]), (policy, i)
    assert sum(not torch.equal(batch[i], images[i]) for i in range(24)) > 8


def test_spec_names_autoaugment_as_timm_does():
    from shardflow.ops import spec

    for name in ("original", "autoaug"):
        (op,) = spec.parse(name)
        assert isinstance(op, ops.AutoAugment) and op.policy == "imagenet"
    with pytest.raises(ValueError, match="augment spec 'v0'.*'original'"):
        spec.parse("v0")


# -- RandomErasing -------------------------------------------------------------------------

@pytest.mark.parametrize("value", [(10, 200, 30), 0])
def test_random_erasing_erases_exactly_the_drawn_box(photos, value):
    """Each erased image: its box (at the batch's size) is the fill, every other pixel the
    image's; the images that drew no erasing, or no box that fits, are untouched."""
    images = photo_tensor(photos * 10)
    op = ops.RandomErasing(p=0.7, value=value)
    params = [op.draw(rng) for rng in _rngs(60)]
    out = op.torch(images, params)
    fill = torch.tensor(value if isinstance(value, tuple) else (value,) * 3, dtype=torch.uint8)
    erased = 0
    for i, seed in enumerate(params):
        box = None if seed is None else op.box(seed, 72, 96)
        if box is None:
            assert torch.equal(out[i], images[i]), i
            continue
        top, left, h, w = box
        inside = torch.zeros(72, 96, dtype=torch.bool)
        inside[top:top + h, left:left + w] = True
        assert torch.equal(out[i][:, inside], fill.view(3, 1).expand(3, h * w)), i
        assert torch.equal(out[i][:, ~inside], images[i][:, ~inside]), i
        erased += h * w > 0
    assert 30 < erased < 55  # about 0.7 of 60 (a box fits nearly always at these scales)


def test_random_erasing_boxes_follow_torchvisions_get_params():
    """Where every try fits (1000 x 1000, scale up to 0.1, ratio 1/2..2): the share of the
    area uniform in `scale`, log(height / width) uniform in log(ratio) (chi-square, 9
    degrees of freedom, below the 0.001 critical value 27.9), the position uniform. The
    ratio is height / width; a box must be strictly smaller than the image (10 x 10 at
    scale 1 never fits: no erasing, as torchvision's fallback)."""
    rng = random.Random(0)
    boxes = [erase_box(rng, 1000, 1000, (0.02, 0.1), (0.5, 2.0)) for _ in range(5000)]
    assert all(b is not None for b in boxes)
    tops, lefts, hs, ws = (np.array(v, dtype=float) for v in zip(*boxes, strict=True))
    share, log_ratio = hs * ws / 1e6, np.log(hs / ws)
    assert chi_square(np.histogram(share, bins=10, range=(0.02, 0.1))[0].tolist()) < 27.9
    assert chi_square(np.histogram(log_ratio, bins=10, range=(-math.log(2), math.log(2)))[0]
                       .tolist()) < 27.9
    assert np.mean(tops / (1000 - hs)) == pytest.approx(0.5, abs=0.02)
    assert np.mean(lefts / (1000 - ws)) == pytest.approx(0.5, abs=0.02)
    tall = [erase_box(rng, 200, 200, (0.05, 0.1), (2.0, 3.0)) for _ in range(200)]
    assert all(b is not None and b[2] > b[3] for b in tall)
    assert erase_box(rng, 10, 10, (1.0, 1.0), (1.0, 1.0)) is None
    nine = {erase_box(rng, 10, 10, (0.81, 0.81), (1.0, 1.0)) for _ in range(100)}
    assert {b[2:] for b in nine} == {(9, 9)} and {b[:2] for b in nine} == {
        (0, 0), (0, 1), (1, 0), (1, 1)}


def test_random_erasing_p_and_its_checks():
    assert sum(ops.RandomErasing(p=0.3).draw(r) is not None for r in _rngs(4000)) / 4000 == \
        pytest.approx(0.3, abs=0.03)
    assert all(ops.RandomErasing(p=0.0).draw(r) is None for r in _rngs(200))
    assert all(ops.RandomErasing(p=1.0).draw(r) is not None for r in _rngs(200))
    with pytest.raises(ValueError, match="value='noise'"):
        ops.RandomErasing(value="noise")
    with pytest.raises(ValueError, match="value=300"):
        ops.RandomErasing(value=300)
    with pytest.raises(ValueError, match="the 3 channels"):
        ops.RandomErasing(p=1.0, value=(1, 2)).torch(torch.zeros(1, 3, 40, 40, dtype=torch.uint8),
                                                     [5])


def test_random_erasing_random_fill_is_uniform_noise_of_the_sample(photos):
    """value="random": noise uniform over the 256 levels, and so are the steps between
    neighbouring pixels (chi-square, 255 degrees of freedom, below the 0.001 critical value
    330.5); each erased box the noise of its sample's seed there, the same in any batch,
    another sample's elsewhere; pixels outside the box untouched."""
    noise = hashed_noise(torch.tensor([7]).view(1, 1, 1, 1), (3, 128, 128))
    flat = noise.flatten().numpy().astype(np.int64)
    assert chi_square(np.bincount(flat, minlength=256).tolist()) < 330.5
    assert chi_square(np.bincount((flat[1:] - flat[:-1]) % 256, minlength=256).tolist()) < 330.5
    other = hashed_noise(torch.tensor([8]).view(1, 1, 1, 1), (3, 128, 128))
    assert (noise == other).float().mean() < 0.01  # about 1/256 equal by chance
    images, keys = photo_tensor(photos * 3), [f"e{i}" for i in range(18)]
    op = ops.RandomErasing(p=1.0, scale=(0.1, 0.3), value="random")
    batch = ops.apply([op], images, ops.sample_rngs(1, 0, keys))
    for i, rng in enumerate(ops.sample_rngs(1, 0, keys)):
        seed = op.draw(rng)
        top, left, h, w = op.box(seed, 72, 96)
        own = hashed_noise(torch.tensor([seed >> 32]).view(1, 1, 1, 1), (3, 72, 96))[0]
        box = (slice(None), slice(top, top + h), slice(left, left + w))
        assert torch.equal(batch[i][box], own[box]), i
        outside = torch.ones(72, 96, dtype=torch.bool)
        outside[box[1:]] = False
        assert torch.equal(batch[i][:, outside], images[i][:, outside]), i
        alone = ops.apply([op], images[i:i + 1], ops.sample_rngs(1, 0, [keys[i]]))
        assert torch.equal(batch[i], alone[0]), i


# -- GaussianBlur --------------------------------------------------------------------------

def _numpy_blur(image: np.ndarray, kx: int, ky: int, sigma: float) -> np.ndarray:
    """torchvision's gaussian_blur in float64: the 2-D kernel of two 1-D ones, reflect
    padding, the weighted sum at each pixel, rounded half to even."""
    def kernel(k: int) -> np.ndarray:
        x = np.linspace(-(k - 1) / 2, (k - 1) / 2, k)
        pdf = np.exp(-0.5 * (x / sigma) ** 2)
        return pdf / pdf.sum()

    k2 = np.outer(kernel(ky), kernel(kx))
    c, h, w = image.shape
    padded = np.pad(image.astype(np.float64), ((0, 0), (ky // 2,) * 2, (kx // 2,) * 2),
                    mode="reflect")
    out = sum(k2[dy, dx] * padded[:, dy:dy + h, dx:dx + w]
              for dy in range(ky) for dx in range(kx))
    return np.round(out).astype(np.uint8)


@pytest.mark.parametrize("kernel, sigma", [(5, 0.8), ((9, 5), 1.7), (13, 2.0), (3, 0.1)])
def test_gaussian_blur_is_torchvisions_definition(photos, kernel, sigma):
    """Separable float32 against the 2-D float64 sum: the same but for a value landing
    within float error of .5 (measured: none, or 2e-5 of the pixels at 13 / 2.0)."""
    op = ops.GaussianBlur(kernel)
    kx, ky = op.kernel_size
    got = op.torch(photo_tensor(photos), [sigma] * 6)
    want = torch.stack([torch.from_numpy(_numpy_blur(np.array(p).transpose(2, 0, 1), kx, ky,
                                                     sigma)) for p in photos])
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, (diff.max(), diff.sum())


@pytest.mark.parametrize("sigma", [1.5, 2.0, 3.0])
def test_gaussian_blur_is_near_pils(photos, sigma):
    """PIL's GaussianBlur(radius=sigma) approximates the Gaussian by three box blurs and
    extends the edges where torchvision reflects: away from the border (half a kernel)
    within 2 levels, 0.26 on average (measured); the kernel 2 * ceil(4 sigma) + 1 wide."""
    k = 2 * math.ceil(4 * sigma) + 1
    got = ops.GaussianBlur(k).torch(photo_tensor(photos), [sigma] * 6)
    want = photo_tensor([p.filter(ImageFilter.GaussianBlur(sigma)) for p in photos])
    b = k // 2
    diff = (got.int() - want.int()).abs()[..., b:-b, b:-b]
    assert diff.max() <= 2 and diff.float().mean() < 0.35, (diff.max(), diff.float().mean())


def test_gaussian_blur_draws_sigma_per_image_and_batches_as_each_alone(photos):
    blur = ops.GaussianBlur(7, sigma=(0.5, 3.0), p=0.8)
    draws = [blur.draw(rng) for rng in _rngs(4000)]
    sigmas = [s for s in draws if s is not None]
    assert len(sigmas) / 4000 == pytest.approx(0.8, abs=0.03)
    assert 0.5 <= min(sigmas) and max(sigmas) <= 3.0
    assert np.mean(sigmas) == pytest.approx(1.75, abs=0.04)
    images = photo_tensor(photos * 3)
    params = [0.6, None, 2.9, 1.3, None, 0.9] * 3
    batch = blur.torch(images, params)
    for i, s in enumerate(params):
        assert torch.equal(batch[i], blur.torch(images[i:i + 1], [s])[0]), i
        assert torch.equal(batch[i], images[i]) == (s is None), i
    flat = torch.full((1, 3, 20, 30), 77, dtype=torch.uint8)  # a normalized kernel: as it is
    assert torch.equal(blur.torch(flat, [2.5]), flat)
    for bad in (4, (3, 0), -1):
        with pytest.raises(ValueError, match="kernel_size"):
            ops.GaussianBlur(bad)
    with pytest.raises(ValueError, match="sigma"):
        ops.GaussianBlur(3, sigma=(2.0, 1.0))


def test_gaussian_blur_is_torchvisions_where_it_imports(photos):
    tf = import_or_skip("torchvision.transforms.functional")
    images = photo_tensor(photos)
    got = ops.GaussianBlur((9, 5)).torch(images, [1.3] * 6)
    want = tf.gaussian_blur(images, [9, 5], [1.3, 1.3])
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


# -- Normalize -----------------------------------------------------------------------------

def test_normalize_is_float_out_last_and_draws_nothing(photos):
    mean, std = (0.485 * 255, 0.456 * 255, 0.406 * 255), (0.229 * 255, 0.224 * 255, 0.225 * 255)
    images = photo_tensor(photos)
    out = ops.apply([ops.Normalize(mean, std)], images, _rngs(6))
    want = (images.double() - torch.tensor(mean).view(1, 3, 1, 1)) / \
        torch.tensor(std).view(1, 3, 1, 1)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), want, atol=1e-5)
    with pytest.raises(ValueError, match="Solarize.*uint8 images"):
        ops.apply([ops.Normalize(mean, std), ops.Solarize(p=1.0)], images, _rngs(6))
    # one mean and std for every channel; no draw from the sample's generator
    jitter = [ops.ColorJitter(0.4, 0.4, 0.4)]
    assert torch.equal(ops.apply([*jitter, ops.Normalize((0.0,), (1.0,))], images, _rngs(6)),
                       ops.apply(jitter, images, _rngs(6)).float())
    rng = random.Random(1)
    state = rng.getstate()
    assert ops.Normalize(mean, std).draw(rng) is True and rng.getstate() == state
    with pytest.raises(ValueError, match="one or three"):
        ops.Normalize((1.0, 2.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="3 means for 1 channels"):
        ops.Normalize(mean, std).torch(images[:, :1], [True] * 6)


# -- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_new_ops_on_cuda_are_the_cpu_ops_and_never_wait_for_the_host(photos):
    """AutoAugment, RandomErasing (its hashed noise too), GaussianBlur and Normalize on the
    GPU: the CPU's pixels (the blur within float rounding at .5), with no host sync."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here")
    recipe = [ops.AutoAugment(), ops.RandomErasing(p=0.7, value="random"),
              ops.GaussianBlur(5, p=0.5), ops.Normalize((127.0, 127.0, 127.0), (64.0,) * 3)]
    images, keys = photo_tensor(photos * 4), [f"g{i}" for i in range(24)]
    cpu = ops.apply(recipe, images, ops.sample_rngs(0, 0, keys))
    on_gpu = images.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = ops.apply(recipe, on_gpu, ops.sample_rngs(0, 0, keys))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    diff = (gpu.cpu() - cpu).abs() * 64.0  # in levels
    assert (diff > 1.01).float().mean() < 0.01 and gpu.device.type == "cuda"


@pytest.mark.parametrize("seed", range(3))
def test_new_ops_on_a_device_never_read_the_host_on_the_cpu_too(photos, seed):
    """The CPU twin of the test above: the same ops on "meta" tensors take every branch a
    GPU takes, and make no host read and no copy from pageable memory, over several draws."""
    recipe = [ops.AutoAugment(), ops.RandomErasing(p=0.7, value="random"),
              ops.GaussianBlur(5, p=0.5), ops.Normalize((127.0, 127.0, 127.0), (64.0,) * 3)]
    keys = [f"g{i}" for i in range(24)]

    def run(images: torch.Tensor) -> None:
        out = ops.apply(recipe, images, ops.sample_rngs(seed, 0, keys))
        assert out.device.type == "meta" and out.shape == images.shape

    assert on_the_device_path(run, photo_tensor(photos * 4)) == []
