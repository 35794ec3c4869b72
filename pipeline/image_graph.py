"""The DALI decode-and-augment graph for images; the device is a parameter.

    encoded bytes, crop window, flip  (external_source, fed per batch by the loader)
      train: decoders.image_slice (region-of-interest decode of the window) -> resize to size
      eval:  decoders.image -> resize (shorter side = size / crop_fraction)
      -> crop_mirror_normalize: flip, centre crop (eval), layout, uint8 or normalized float

`device="cpu"` runs everything on the CPU (`device_id=None`); `device="gpu"` decodes with
nvJPEG ("mixed", `hw_decoder_load` of it on the hardware decoder) and augments on the GPU.
Normalization runs in the graph only when asked for there; by default images leave as uint8
(4x fewer bytes) and the prefetcher normalizes them on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
Layout = Literal["NHWC", "NCHW"]


@dataclass(frozen=True)
class GraphSpec:
    """What the graph computes. Built once per loader (and again after a decode failure)."""

    train: bool
    size: int
    device: Literal["cpu", "gpu"]
    layout: Layout = "NCHW"
    normalize: bool = False  # float output, normalized inside the graph
    crop_fraction: float = 0.875
    antialias: bool = True
    hw_decoder_load: float = 0.65
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD


INPUTS = ("encoded", "anchor", "shape", "flip")  # the last three only when training


def build(spec: GraphSpec, *, batch_size: int, num_threads: int, device_id: int | None,
          seed: int, prefetch_depth: int = 2) -> Any:
    """A built DALI pipeline whose inputs are fed with `feed_input(name, ...)` per batch."""
    from nvidia.dali import pipeline_def

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                  seed=seed, prefetch_queue_depth=prefetch_depth, exec_async=False,
                  exec_pipelined=False)
    def graph() -> Any:
        return _graph(spec)

    pipe = graph()
    pipe.build()
    return pipe


def _graph(spec: GraphSpec) -> Any:
    from nvidia.dali import fn, types

    encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
    flip: Any = 0
    decode_device = "mixed" if spec.device == "gpu" else "cpu"
    extra = {"hw_decoder_load": spec.hw_decoder_load} if spec.device == "gpu" else {}
    interp = types.INTERP_LINEAR if not spec.antialias else types.INTERP_TRIANGULAR
    if spec.train:
        anchor = fn.external_source(name="anchor", dtype=types.INT32, ndim=1)
        shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
        flip = fn.external_source(name="flip", dtype=types.INT32, ndim=0)
        images = fn.decoders.image_slice(encoded, anchor, shape, device=decode_device,
                                         output_type=types.RGB, adjust_orientation=False,
                                         normalized_anchor=False, normalized_shape=False,
                                         **extra)
        images = fn.resize(images, resize_x=spec.size, resize_y=spec.size, interp_type=interp,
                           antialias=spec.antialias)
        crop: tuple[int, int] | None = None
    else:
        images = fn.decoders.image(encoded, device=decode_device, output_type=types.RGB,
                                   adjust_orientation=False, **extra)
        images = fn.resize(images, resize_shorter=round(spec.size / spec.crop_fraction),
                           interp_type=interp, antialias=spec.antialias)
        crop = (spec.size, spec.size)
    return _finish(images, flip, crop, spec)


def _finish(images: Any, flip: Any, crop: tuple[int, int] | None, spec: GraphSpec) -> Any:
    from nvidia.dali import fn, types

    norm = {"mean": list(spec.mean), "std": list(spec.std)} if spec.normalize else {}
    return fn.crop_mirror_normalize(
        images, mirror=flip, crop=crop, output_layout="CHW" if spec.layout == "NCHW" else "HWC",
        dtype=types.FLOAT if spec.normalize else types.UINT8, **norm)
