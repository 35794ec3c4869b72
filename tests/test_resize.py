"""The CPU resize stage: same filter as torch/torchvision, flips, centre crops, threads."""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from pipeline import resize


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_train_batch_matches_torch_bilinear_antialias_and_flips():
    images = [_image(90, 70, 1), _image(40, 50, 2)]
    out = resize.train_batch(images, [False, True], 32, channels_first=True)
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.uint8
    for i, img in enumerate(images):
        ref = F.interpolate(torch.from_numpy(img).permute(2, 0, 1)[None].float(), size=(32, 32),
                            mode="bilinear", antialias=True, align_corners=False)[0]
        got = out[i].flip(-1) if i == 1 else out[i]
        assert (got.float() - ref).abs().max() <= 1.0  # uint8 rounding only


def test_nhwc_layout_is_the_same_pixels():
    images = [_image(60, 80)]
    nchw = resize.train_batch(images, [False], 24, channels_first=True)
    nhwc = resize.train_batch(images, [False], 24, channels_first=False)
    assert torch.equal(nchw.permute(0, 2, 3, 1), nhwc)


def test_eval_batch_resizes_the_shorter_side_then_crops_the_centre():
    img = np.zeros((100, 200, 3), np.uint8)
    img[:, 95:105] = 255  # a vertical bar in the middle stays in the middle
    out = resize.eval_batch([img], 32, 0.5, channels_first=True)
    assert out.shape == (1, 3, 32, 32)
    column = out[0, 0].float().mean(0)
    assert column[14:18].min() > 100 and column[:8].max() < 5 and column[-8:].max() < 5


def test_one_core_setting_stays_in_its_thread():
    before = torch.get_num_threads()
    seen = {}

    def stage() -> None:
        resize.one_core_in_this_thread()
        seen["stage"] = torch.get_num_threads()

    thread = threading.Thread(target=stage)
    thread.start()
    thread.join()
    later = threading.Thread(target=lambda: seen.update(later=torch.get_num_threads()))
    later.start()
    later.join()
    assert seen["stage"] == 1
    assert torch.get_num_threads() == before and seen["later"] == before
