"""Delivery: batches to the device they train on, overlapping the training step.

On the CPU a batch is handed over as it is (normalized when asked). On CUDA every loader owns
one `DeviceCopier`, and every batch follows **the stream contract**:

1. The copier has one side stream S on the loader's device. Everything a batch is made of on
   the GPU is allocated and written inside S's context: the host-to-device copies, the
   normalization and its temporaries, a GPU decoder's output copied out of DALI's buffer
   (`shardflow.dali.to_cuda`), voxels computed on the GPU. Allocation inside S's context
   matters: the caching allocator ties a block to the stream it was allocated on, so a block
   freed by S is reused only by S's later work, in S's order.
2. A host batch is first copied (by the CPU) into a **pinned buffer of a ring** (`PinnedRing`,
   `slots` = prefetch depth + 2 per tensor of the batch): the host-to-device copy from pinned
   memory is asynchronous, and a buffer is refilled only after the event recorded after the
   copy that read it has completed, so no copy ever reads bytes the next batch overwrote, and
   no pinned memory is allocated per batch.
3. After a batch's last operation an event E is recorded on S; the batch travels with E.
4. The consumer, on the current stream C of the batch's device, waits on E before touching
   the tensors (`C.wait_event(E)`: a GPU-side wait, no host sync), and calls
   `t.record_stream(C)` on every CUDA tensor of the batch: their blocks belong to S, and
   without it S could be handed one of them for the next batch while C still reads it
   (`shardflow.loading.loader._wait`).
5. Temporaries allocated and freed on S (the uint8 image before normalizing, the points before
   dropping bad clouds) need nothing more: S runs in order, so no later S work can overtake
   their readers.
6. DALI reuses its output buffer once the next output is asked for: `shardflow.dali.to_cuda`
   waits (host, in the decode thread) for its copy out of it before returning.
"""

from __future__ import annotations

from typing import Any


def as_tensor(array: Any) -> Any:
    """A torch tensor over `array` (numpy or torch), without copying."""
    import torch

    return array if isinstance(array, torch.Tensor) else torch.from_numpy(array)


class PinnedRing:
    """`slots` pinned host buffers used in turn for one tensor of a batch (see the contract)."""

    def __init__(self, slots: int) -> None:
        self.buffers: list[Any] = [None] * slots
        self.events: list[Any] = [None] * slots
        self.next, self.last = 0, 0

    def stage(self, tensor: Any) -> Any:
        """`tensor`'s values in the next pinned buffer (grown to the largest batch seen, then
        reused), as a tensor of its shape and dtype."""
        import torch

        i, self.last = self.next, self.next
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            # A host wait only when the copies run `slots` batches behind the producer.
            self.events[i].synchronize()
        need = tensor.numel() * tensor.element_size()
        if self.buffers[i] is None or self.buffers[i].numel() < need:
            self.buffers[i] = torch.empty(max(need, 1), dtype=torch.uint8, pin_memory=True)
        view = self.buffers[i][:need].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        return view

    def release(self, event: Any) -> None:
        """The last staged buffer may be refilled once `event` has completed."""
        self.events[self.last] = event


class DeviceCopier:
    """Moves host batches to `device` following the stream contract: pinned ring, side
    stream, normalization there (when mean/std are set), a ready event per batch."""

    def __init__(self, device: Any, mean: tuple[float, ...] | None,
                 std: tuple[float, ...] | None, channels_first: bool, slots: int = 4) -> None:
        import torch

        self.device = torch.device(*device) if isinstance(device, tuple) else torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.slots = max(2, slots)
        self._rings: list[PinnedRing] = []
        self._staged: list[PinnedRing] = []  # the rings the batch being copied staged into
        shape = (1, -1, 1, 1) if channels_first else (1, 1, 1, -1)
        self.mean = None if mean is None else torch.tensor(mean, device=self.device).view(shape)
        self.std = None if std is None else torch.tensor(std, device=self.device).view(shape)

    def pinned(self, array: Any) -> Any:
        """A host tensor over `array` (numpy or torch). Kept for callers of the old API: the
        copier now stages host tensors into its own pinned ring when it copies them."""
        return as_tensor(array)

    def __call__(self, image: Any, label: Any) -> tuple[Any, Any, Any]:
        """(image, label, ready event or None). Normalizes when mean/std are set; `label`
        may be None (label-free batches)."""
        import torch

        if not self.cuda:
            return self._normalize(as_tensor(image)), \
                None if label is None else as_tensor(label), None
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            image, label = self._to_device((image, label))
            image = self._normalize(image)
            ready = self._record()
        return image, label, ready

    def move(self, *tensors: Any) -> tuple[tuple[Any, ...], Any]:
        """Host tensors (or None) to the device: (tensors there, ready event or None)."""
        import torch

        if not self.cuda:
            return tuple(None if t is None else as_tensor(t) for t in tensors), None
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            moved = self._to_device(tensors)
            ready = self._record()
        return tuple(moved), ready

    def _to_device(self, tensors: tuple[Any, ...]) -> list[Any]:
        while len(self._rings) < len(tensors):
            self._rings.append(PinnedRing(self.slots))
        out, self._staged = [], []
        for ring, t in zip(self._rings, tensors, strict=False):
            if t is None or (t := as_tensor(t)).is_cuda:
                out.append(t)  # None, or decoded on the GPU: already here, written on S
                continue
            out.append(ring.stage(t).to(self.device, non_blocking=True))
            self._staged.append(ring)
        return out

    def _record(self) -> Any:
        import torch

        ready = torch.cuda.Event()
        ready.record(self.stream)
        for ring in self._staged:  # the buffers this batch's copies read
            ring.release(ready)
        return ready

    def _normalize(self, image: Any) -> Any:
        if self.mean is None or self.std is None:
            return image
        return (image.float() - self.mean) / self.std
