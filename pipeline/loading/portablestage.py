"""The portable backend (no DALI): each sample decoded in a thread pool, batches ahead. A
modality's decode stage (graphstage.DecodeCore) holds a `ThreadBackend` and supplies the
decode of one sample (`_decode_one`, run in the pool) and the batch from the decoded samples
(`_assemble`), as the image and point-cloud stages do.

    reader stage items (EncodedBatch, per-sample columns)
      -> each sample's `_decode_one(bytes, parameters)` in a pool of `threads` threads, the
         next batches submitted before this one is assembled (PIL and numpy release the GIL
         while they decode, so the pool runs on every core)
      -> a sample whose decode raised a DataError is raised or skipped (recorded with the
         batch), as the DALI backend does with the samples its graph refuses
      -> _assemble(item, decoded) in this thread -> (item, output) to the stage's _finish
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from shardflow.errors import DataError
from shardflow.loading.batch import EncodedBatch
from shardflow.loading.graphstage import Item

AHEAD = 2  # batches submitted to the pool beyond the one being assembled (as GraphRunner)


class ThreadStage(Protocol):
    """What a ThreadBackend asks of its stage."""

    def _decode_one(self, data: Any, params: Any) -> Any:
        """One sample decoded (in a pool thread) from its bytes (uint8 numpy) and the
        parameters the reader stage drew for it; DataError when it cannot be."""

    def _assemble(self, item: Item, decoded: list[Any]) -> Any:
        """The batch output the stage's `_finish` takes (as the DALI backend's `_fetch` gives
        it) from the decoded samples of `item`, aligned with what is left of it."""

    def _handle(self, err: DataError, enc: EncodedBatch, i: int) -> None: ...


class ThreadBackend:
    """Runs one pass's decodes in a thread pool of its own: no thread outlives the pass (an
    epoch, or what a break or close() left of it), so a loader never closed leaks none."""

    def __init__(self, stage: ThreadStage, threads: int) -> None:
        self.stage, self.threads = stage, threads

    def run(self, prepared: Iterable[Item], stop: threading.Event
            ) -> Iterator[tuple[Item, Any]]:
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardflow-decode")
        pending: deque[tuple[Item, list[Future[Any]]]] = deque()
        try:
            for item in prepared:
                pending.append((item, self._submit(pool, item)))
                if len(pending) > AHEAD:
                    if stop.is_set():
                        return
                    yield self._complete(*pending.popleft())
            while pending and not stop.is_set():
                yield self._complete(*pending.popleft())
        finally:
            # Decodes not yet begun are dropped; those running finish (milliseconds).
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Nothing is held between passes (each pass's pool ends with it)."""

    def _submit(self, pool: ThreadPoolExecutor, item: Item) -> list[Future[Any]]:
        enc, _labels, params = item[0], item[1], item[2]
        return [pool.submit(self.stage._decode_one, enc.data[i], params[i])
                for i in range(len(enc))]

    def _complete(self, item: Item, futures: list[Future[Any]]) -> tuple[Item, Any]:
        """`item` and its batch output once its samples are decoded; those refused are raised
        or dropped from `item` (every column), in order, as the DALI backend drops them."""
        enc, decoded, bad = item[0], [], []
        for i, future in enumerate(futures):
            try:
                decoded.append(future.result())
            except DataError as err:
                bad.append(i)
                self.stage._handle(err, enc, i)  # raises under on_error="raise"
        for i in reversed(bad):
            enc.drop(i)
            for column in item[1:]:
                del column[i]
        return item, self.stage._assemble(item, decoded) if decoded else None
