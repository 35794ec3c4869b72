"""The DALI decode graph for images; the device is a parameter.

    encoded bytes, crop window (anchor, shape), flip   (external_source, fed per batch)
      -> decoders.image_slice: region-of-interest decode of the window
      -> with `resize`: resize to size x size and crop_mirror_normalize (flip, layout)

The window is chosen in Python from the image header (a random-resized crop when training,
the centre crop when evaluating), so one graph serves both. `device="cpu"` decodes on the CPU
(`device_id=None`) and leaves resizing to torch (resize.py measured faster there);
`device="gpu"` decodes with nvJPEG ("mixed", `hw_decoder_load` of it on the hardware decoder)
and resizes and flips on the GPU. Images leave as uint8; normalization is done on the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

T = TypeVar("T")
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


def build(spec: GraphSpec, *, batch_size: int, num_threads: int, device_id: int | None,
          seed: int, prefetch_depth: int = 2) -> Any:
    """A built DALI pipeline whose inputs are fed with `feed_input(name, ...)` per batch and
    run with `schedule_run()` / `outputs()` (see GraphRunner)."""
    from nvidia.dali import pipeline_def

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                  seed=seed, prefetch_queue_depth=prefetch_depth)
    def graph() -> Any:
        return _graph(spec)

    pipe = graph()
    pipe.build()
    return pipe


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
    norm: dict[str, Any] = {"dtype": types.UINT8}
    if spec.normalize is not None:
        norm = {"dtype": types.FLOAT, "mean": list(spec.normalize[0]),
                "std": list(spec.normalize[1])}
    return fn.crop_mirror_normalize(images, mirror=flip,
                                    output_layout="CHW" if spec.layout == "NCHW" else "HWC",
                                    **norm)


class GraphRunner:
    """Runs a graph up to `depth` batches ahead of its consumer (DALI's pipelined executor),
    pairing every output with the batch that went in; `fetch(output, batch)` copies an
    output out before the graph runs again. Empty batches (every sample skipped)
    pass through in their place with output None, so the batch count never changes.

    When an iteration fails, `on_failure(item, error)` gets the batch that went in: it
    returns the batch to run again (its bad samples removed; possibly empty) or raises. The
    graph is then rebuilt and every batch still in flight is fed again.
    """

    def __init__(self, build: Callable[[int], Any], feed: Callable[[Any, Any], None],
                 fetch: Callable[[Any, Any], Any], is_empty: Callable[[Any], bool],
                 depth: int) -> None:
        self.build, self.feed, self.fetch, self.is_empty = build, feed, fetch, is_empty
        self.depth = max(1, depth)
        self.graph: Any = None
        self.built_depth = self.depth

    def run(self, items: Iterator[T], on_failure: Callable[[T, Exception], T]
            ) -> Iterator[tuple[T, Any]]:
        pending: deque[list[Any]] = deque()  # [item, fed into the current graph?]
        try:
            yield from self._run(iter(items), pending, on_failure)
        finally:
            if any(fed for _, fed in pending) or self.built_depth < self.depth:
                # Abandoned with batches inside (a `break`, close(), an error), or shallow
                # after a rebuild: a later pass must not get their outputs.
                self.graph = None

    def close(self) -> None:
        self.graph = None

    def _run(self, source: Iterator[T], pending: deque[list[Any]],
             on_failure: Callable[[T, Exception], T]) -> Iterator[tuple[T, Any]]:
        while True:
            self._fill(source, pending)
            if not pending:
                return
            head = pending[0][0]
            if self.is_empty(head):
                pending.popleft()
                yield head, None
                continue
            if self.graph is None:
                self._start(pending)
            try:
                (out,) = self.graph.outputs()
                result = self.fetch(out, head)  # before the next run reuses the buffers
            except RuntimeError as exc:
                self.graph = None  # a pipeline that failed is not used again
                pending[0][0] = on_failure(head, exc)
                for entry in pending:
                    entry[1] = False
                continue
            pending.popleft()
            yield head, result

    def _fill(self, source: Iterator[T], pending: deque[list[Any]]) -> None:
        while len(pending) < self.depth and (item := next(source, None)) is not None:
            entry = [item, False]
            pending.append(entry)
            if self.graph is not None and not self.is_empty(item):
                self.feed(self.graph, item)
                self.graph.schedule_run()
                entry[1] = True

    def _start(self, pending: deque[list[Any]]) -> None:
        """Build the graph and feed what is waiting: its first scheduled run prefetches that
        many iterations at once."""
        waiting = [e for e in pending if not self.is_empty(e[0])]
        self.graph, self.built_depth = self.build(len(waiting)), len(waiting)
        for entry in waiting:
            self.feed(self.graph, entry[0])
            entry[1] = True
        self.graph.schedule_run()
