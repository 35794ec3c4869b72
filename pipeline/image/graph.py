"""The DALI decode graph for images; the device is a parameter.

    encoded bytes, crop window (anchor, shape), flip   (external_source, fed per batch)
      -> decoders.image_slice: region-of-interest decode of the window
      -> with `resize`: resize to size x size, turn upright by the EXIF orientation (an exact
         nearest-neighbour warp of the square: transpose, vertical flip) and
         crop_mirror_normalize (horizontal flip, layout)

The window is chosen in Python from the image header (a random-resized crop when training,
the centre crop when evaluating), so one graph serves both. `device="cpu"` decodes on the CPU
(`device_id=None`) and leaves resizing to torch (resize.py measured faster there);
`device="gpu"` decodes with nvJPEG ("mixed", `hw_decoder_load` of it on the hardware decoder)
and resizes and flips on the GPU. Images leave as uint8; normalization is done on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shardflow import dali

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
Layout = Literal["NHWC", "NCHW"]


@dataclass(frozen=True)
class GraphSpec:
    """What the graph computes. Built once per loader (and again after a decode failure)."""

    size: int
    device: Literal["cpu", "gpu"]
    layout: Layout = "NCHW"
    interp: Literal["linear", "triangular", "cubic"] = "linear"
    antialias: bool = True
    fast_idct: bool = False  # libjpeg-turbo's faster, slightly less exact integer IDCT
    resize: bool = True  # False: the graph only decodes (the CPU path resizes with torch)
    hw_decoder_load: float = 0.65
    # (mean, std) in 0..255 units: float32 (x - mean) / std out of the graph; None: uint8
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # With `resize`: an "orient" input (per sample, the 2x3 matrix of `orient_matrix`) turns
    # the square output upright; the decoder's own adjust_orientation stays off (augment.py).
    exif_orientation: bool = True
    # With `resize`: shardflow.ops ops with a DALI form (Op.dali_inputs), run on the resized,
    # upright, flipped image before the layout; each op's per-sample inputs are fed as
    # "op{j}_{name}" (decode.py draws them from the ops' generators).
    ops: tuple[Any, ...] = ()


def build(spec: GraphSpec, **options: Any) -> Any:
    """The built graph (see shardflow.dali.build for `options`)."""
    return dali.build(lambda: _graph(spec), **options)


def _graph(spec: GraphSpec) -> Any:
    from nvidia.dali import fn, types

    encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
    anchor = fn.external_source(name="anchor", dtype=types.INT32, ndim=1)
    shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
    extra: dict[str, Any] = {"use_fast_idct": spec.fast_idct}
    if spec.device == "gpu":
        extra["hw_decoder_load"] = spec.hw_decoder_load
    images = fn.decoders.image_slice(encoded, anchor, shape,
                                     device="mixed" if spec.device == "gpu" else "cpu",
                                     output_type=types.RGB, adjust_orientation=False,
                                     normalized_anchor=False, normalized_shape=False, **extra)
    if not spec.resize:
        return images
    interp = {"linear": types.INTERP_LINEAR, "triangular": types.INTERP_TRIANGULAR,
              "cubic": types.INTERP_CUBIC}[spec.interp]
    flip = fn.external_source(name="flip", dtype=types.INT32, ndim=0)
    images = fn.resize(images, resize_x=spec.size, resize_y=spec.size, interp_type=interp,
                       antialias=spec.antialias)
    if spec.exif_orientation:
        turn = fn.external_source(name="orient", dtype=types.FLOAT, ndim=2)
        # `matrix` as an argument input: a CPU input, whichever device the warp runs on.
        images = fn.warp_affine(images, matrix=turn, size=[spec.size, spec.size],
                                interp_type=types.INTERP_NN)
    if spec.ops:  # the loader's flip first, as resize.py's comes before torch's ops
        images, flip = fn.flip(images, horizontal=flip, vertical=0), 0
    for j, op in enumerate(spec.ops):  # argument inputs: CPU nodes, whatever the device
        inputs = {name: fn.external_source(name=f"op{j}_{name}", dtype=getattr(types, kind),
                                           ndim=ndim)
                  for name, (kind, ndim) in op.dali_inputs.items()}
        images = op.dali(images, inputs)
    norm: dict[str, Any] = {"dtype": types.UINT8}
    if spec.normalize is not None:
        norm = {"dtype": types.FLOAT, "mean": list(spec.normalize[0]),
                "std": list(spec.normalize[1])}
    return fn.crop_mirror_normalize(images, mirror=flip,
                                    output_layout="CHW" if spec.layout == "NCHW" else "HWC",
                                    **norm)


def orient_matrix(transpose: bool, vflip: bool, size: int) -> list[list[float]]:
    """warp_affine's destination -> source map (pixel-corner coordinates) of a size x size
    image transposed, then flipped vertically. Pixel centres land on pixel centres, so the
    nearest-neighbour warp moves pixels exactly (checked against numpy in the tests)."""
    rows = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    if vflip:  # undo the flip: y -> size - y
        rows = [rows[0], [0.0, -1.0, float(size)]]
    if transpose:  # then the transpose: swap the source coordinates
        rows = [rows[1], rows[0]]
    return rows
