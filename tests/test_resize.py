"""The CPU resize stage: same filter as torch/torchvision, flips, centre crops, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardflow.image import resize
from shardflow.loading.prefetch import one_core_in_this_thread


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_train_batch_matches_torch_bilinear_antialias_and_flips():
    images = [_image(90, 70, 1), _image(40, 50, 2)]
    out = resize.batch(images, [False, True], 32, True, None)
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.uint8
    for i, img in enumerate(images):
        ref = F.interpolate(torch.from_numpy(img).permute(2, 0, 1)[None].float(), size=(32, 32),
                            mode="bilinear", antialias=True, align_corners=False)[0]
        got = out[i].flip(-1) if i == 1 else out[i]
        assert (got.float() - ref).abs().max() <= 1.0  # uint8 rounding only


def test_nhwc_layout_is_the_same_pixels():
    images = [_image(60, 80)]
    nchw = resize.batch(images, [False], 24, True, None)
    nhwc = resize.batch(images, [False], 24, False, None)
    assert torch.equal(nchw.permute(0, 2, 3, 1), nhwc)


def test_normalize_gives_float_mean_std_units():
    images = [np.full((10, 10, 3), 128, np.uint8)]
    out = resize.batch(images, [False], 4, True, ((128.0, 0.0, 255.0), (2.0, 1.0, 5.0)))
    assert out.dtype == torch.float32
    assert out[0, :, 0, 0].tolist() == pytest.approx([0.0, 128.0, -25.4])


def test_center_crop_window_is_a_centred_square():
    from shardflow.image.augment import center_crop

    w = center_crop(200, 100, 0.5)
    assert (w.x, w.y, w.width, w.height, w.flip) == (75, 25, 50, 50, False)
    thin = center_crop(20000, 1, 0.875)  # a 1-pixel-high image stays a tiny window
    assert thin.width == thin.height == 1


def test_one_core_setting_stays_in_its_thread():
    before = torch.get_num_threads()
    seen = {}

    def stage() -> None:
        one_core_in_this_thread()
        seen["stage"] = torch.get_num_threads()

    thread = threading.Thread(target=stage)
    thread.start()
    thread.join()
    later = threading.Thread(target=lambda: seen.update(later=torch.get_num_threads()))
    later.start()
    later.join()
    assert seen["stage"] == 1
    assert torch.get_num_threads() == before and seen["later"] == before


def test_one_core_holds_after_another_thread_set_torchs_count():
    """A count given to torch.set_num_threads by another thread (FFCV's loader does this, in
    the benchmark's process) is copied into each new thread by torch's first-use setup: that
    setup must not run after one_core_in_this_thread, undoing it."""
    before = torch.get_num_threads()
    setter = threading.Thread(target=lambda: torch.set_num_threads(2))
    setter.start()
    setter.join()
    seen = {}

    def stage() -> None:
        one_core_in_this_thread()
        seen["stage"] = torch.get_num_threads()

    try:
        thread = threading.Thread(target=stage)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert seen["stage"] == 1


@pytest.mark.parametrize("channels_first", [True, False])
def test_fused_normalize_equals_normalizing_the_uint8_batch(channels_first):
    """The float batch is normalized image by image as it is written; it must equal the
    uint8 batch normalized afterwards (torchvision's ToTensor + Normalize) within 1e-5."""
    images = [_image(90, 70, 1), _image(300, 200, 2), _image(33, 41, 3)]
    flips, turns = [False, True, True], [(False, False), (True, False), (True, True)]
    mean = (0.485 * 255, 0.456 * 255, 0.406 * 255)
    std = (0.229 * 255, 0.224 * 255, 0.225 * 255)
    u8 = resize.batch(images, flips, 48, channels_first, None, turns)
    got = resize.batch(images, flips, 48, channels_first, (mean, std), turns)
    shape = (1, 3, 1, 1) if channels_first else (1, 1, 1, 3)
    ref = (u8.float() / 255 - torch.tensor([0.485, 0.456, 0.406]).view(shape)) \
        / torch.tensor([0.229, 0.224, 0.225]).view(shape)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-5


def test_batch_writes_into_a_given_buffer_and_checks_its_shape():
    images = [_image(60, 80)]
    out = torch.full((1, 3, 24, 24), 7, dtype=torch.uint8)
    got = resize.batch(images, [False], 24, True, None, out=out)
    assert got is out and torch.equal(out, resize.batch(images, [False], 24, True, None))
    with pytest.raises(ValueError, match="want"):
        resize.batch(images, [False], 24, True, ((0.0,) * 3, (1.0,) * 3), out=out)
