"""DALI helpers every graph shares: building a graph fed from Python, running it ahead of its
consumer (`GraphRunner`), copying a GPU output into a torch tensor, and a DALI error in one line.

DALI is imported inside the functions: `import shardflow` works where DALI is not installed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

# DALI's wheels are built per CUDA major version and all install the package nvidia.dali, so
# only one can be in an environment. pyproject depends on the design card's (CUDA 12); a torch
# built for CUDA 13 wants the other (`make dali-cuda13` swaps them in .venv).
DEFAULT_WHEEL = "nvidia-dali-cuda120"
WHEELS = {"12": "nvidia-dali-cuda120", "13": "nvidia-dali-cuda130"}


def wheel_for(cuda_version: str | None) -> str:
    """The DALI wheel for a torch built for `cuda_version` (torch.version.cuda: "12.8",
    "13.0"); the default for a CPU-only torch (DALI's CPU operators run with either) or a
    CUDA major version DALI has no wheel for."""
    return WHEELS.get((cuda_version or "").split(".")[0], DEFAULT_WHEEL)


def install_hint() -> str:
    """What to install for this torch: `pip install <wheel>`, and why when it is not the
    default."""
    import torch

    wheel = wheel_for(torch.version.cuda)
    if wheel == DEFAULT_WHEEL:
        return f"pip install {wheel}"
    return (f"pip uninstall {DEFAULT_WHEEL}; pip install {wheel} (this torch is built for "
            f"CUDA {torch.version.cuda}; in the project's .venv: make dali-cuda13)")


def build(graph: Callable[[], Any], *, batch_size: int, num_threads: int,
          device_id: int | None, seed: int, prefetch_depth: int = 2) -> Any:
    """A built DALI pipeline of `graph()`'s operators, whose inputs are fed with
    `feed_input(name, ...)` per batch and run with `schedule_run()` / `outputs()` (see
    GraphRunner). `device_id=None` runs it on the CPU only."""
    from nvidia.dali import pipeline_def

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                  seed=seed, prefetch_queue_depth=prefetch_depth)
    def pipe() -> Any:
        return graph()

    built = pipe()
    built.build()
    return built


class CopyFence:
    """The copies queued out of a graph's current output buffers (CUDA events). DALI may
    refill those buffers once its next output is asked for, or free them with the graph; the
    runner waits here just before either, not right after queuing the copies: by then they
    are long done, so the decode thread does not stall on each batch's copy."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def add(self, event: Any) -> None:
        self.events.append(event)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events.clear()


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
        self.fence = CopyFence()  # `fetch`'s device copies out of the current outputs

    def run(self, items: Iterator[T], on_failure: Callable[[T, Exception], T]
            ) -> Iterator[tuple[T, Any]]:
        pending: deque[list[Any]] = deque()  # [item, fed into the current graph?]
        try:
            yield from self._run(iter(items), pending, on_failure)
        finally:
            if any(fed for _, fed in pending) or self.built_depth < self.depth:
                # Abandoned with batches inside (a `break`, close(), an error), or shallow
                # after a rebuild: a later pass must not get their outputs.
                self._drop()

    def close(self) -> None:
        self._drop()

    def _drop(self) -> None:
        """Let the graph go (its buffers with it) once the copies out of them are done."""
        self.fence.wait()
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
                self.fence.wait()  # the last output's copies: done before DALI reuses it
                (out,) = self.graph.outputs()
                result = self.fetch(out, head)  # before the next run reuses the buffers
            except RuntimeError as exc:
                self._drop()  # a pipeline that failed is not used again
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


def to_cuda(batch: Any, dtype: Any, cuda_index: int | None, stream: Any,
            fence: CopyFence) -> Any:
    """A dense DALI GPU batch copied into a new CUDA tensor on `stream` (the copier's side
    stream; see the stream contract in pipeline/loading/delivery.py). The copy's event goes
    into `fence` (its GraphRunner's), waited on before DALI may reuse the batch's buffer."""
    import torch
    from nvidia.dali.plugin.pytorch import feed_ndarray

    dense = batch.as_tensor()
    with torch.cuda.stream(stream):
        # Allocated on the side stream, where it is written: a block allocated on the
        # decode thread's default stream could be memory the training step still reads.
        tensor = torch.empty(dense.shape(), dtype=dtype,
                             device=torch.device("cuda", cuda_index or 0))
        feed_ndarray(dense, tensor, cuda_stream=stream)
        copied = torch.cuda.Event()
        copied.record(stream)
    fence.add(copied)
    return tensor


def reason(exc: Exception) -> str:
    """The operator's own words from a DALI error (which opens with the graph's traceback)."""
    text = str(exc)
    text = text.split("encountered:", 1)[-1].split("C++ context:", 1)[0]
    return " ".join(text.split())[:200]
