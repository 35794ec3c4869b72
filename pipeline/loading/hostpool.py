"""Host batch buffers reused once nobody holds them.

A float batch of 64 images at 224 px is 38 MB. Allocated afresh for every batch, glibc hands
memory that size out by mmap and returns it at free, so each batch pays the kernel for
zeroing and faulting in ~9,400 new pages: measured 16 ms a batch here, more than the
normalization it holds (tools/bench_loader.py). So the decode stages write their output into
a buffer of this pool, and a buffer is written again only when nothing outside the pool holds
it: no Python reference to the tensor (the batch, a list, a numpy array over it), no other
tensor over its storage (a view, a slice), no C++ owner (autograd keeping the input for the
backward pass). A batch a user keeps is never overwritten; when every buffer is held, a new
tensor is allocated and takes the place of the oldest in the pool, which stays at `slots`.

Where torch lacks the use counts this relies on (private functions), nothing is reused:
every batch is a new tensor, as before.
"""

from __future__ import annotations

import sys

import torch

_storage_uses = getattr(torch._C, "_storage_Use_Count", None)
if not hasattr(torch.Tensor, "_use_count"):
    _storage_uses = None  # no way to see autograd's hold on a batch: reuse nothing


class HostPool:
    """At most `slots` host tensors, each handed out again once it is free (see above)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.buffers: list[torch.Tensor] = []
        self.reused = 0  # how many batches were written into a buffer again (for tests)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype` that nobody else holds."""
        if _storage_uses is None:
            return torch.empty(shape, dtype=dtype)
        for i in range(len(self.buffers)):
            if self.buffers[i].shape == shape and self.buffers[i].dtype == dtype \
                    and self._free(i):
                self.reused += 1
                return self.buffers[i]
        fresh = torch.empty(shape, dtype=dtype)
        if len(self.buffers) >= self.slots:
            # Forget one: a free one of another shape, else the oldest; whoever holds it
            # keeps it (the pool only stops reusing it).
            del self.buffers[next((i for i in range(len(self.buffers)) if self._free(i)), 0)]
        self.buffers.append(fresh)
        return fresh

    def _free(self, i: int) -> bool:
        """Whether buffer i is held by nothing but this pool."""
        t = self.buffers[i]
        # Python references: the pool's list, `t`, getrefcount's argument. C++ owners of the
        # tensor: its Python object. Of the storage: the tensor and the temporary storage
        # object that _storage_count makes.
        uses = t._use_count()  # type: ignore[attr-defined]
        return sys.getrefcount(t) <= 3 and uses == 1 and _storage_count(t) <= 2

    def clear(self) -> None:
        self.buffers.clear()


def _storage_count(t: torch.Tensor) -> int:
    assert _storage_uses is not None
    return int(_storage_uses(t.untyped_storage()._cdata))

