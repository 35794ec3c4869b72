"""HostPool: batch buffers are written again only when nothing outside the pool holds them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardflow.loading import hostpool
from shardflow.loading.hostpool import HostPool

pytestmark = pytest.mark.skipif(hostpool._storage_uses is None,
                                reason="this torch has no storage use count: nothing reused")
SHAPE = (2, 3, 4, 4)


def _fill(pool: HostPool, value: int) -> torch.Tensor:
    t = pool.take(SHAPE, torch.float32)
    t.fill_(value)
    return t


def test_a_released_buffer_is_reused():
    pool = HostPool(2)
    first = _fill(pool, 1)
    ptr = first.data_ptr()
    del first
    again = pool.take(SHAPE, torch.float32)
    assert again.data_ptr() == ptr and pool.reused == 1


def _hold_object(t):
    return t


def _hold_view(t):
    return t[1:]


def _hold_numpy(t):
    return t.numpy()


def _hold_in_a_list(t):
    return [t]


def _hold_in_autograd(t):
    w = torch.ones(4, 4, requires_grad=True)
    return (t @ w).sum()  # matmul keeps its input for the backward pass


def _hold_storage_only(t):
    return torch.empty(0).set_(t.untyped_storage())


@pytest.mark.parametrize("hold", [_hold_object, _hold_view, _hold_numpy, _hold_in_a_list,
                                  _hold_in_autograd, _hold_storage_only])
def test_a_held_buffer_is_never_overwritten(hold):
    pool = HostPool(3)
    first = _fill(pool, 1)
    held = hold(first)
    del first
    for value in range(2, 8):  # more batches than slots: fresh tensors, none written over
        _fill(pool, value)
    kept = pool.buffers[0]
    assert torch.all(kept == 1)
    assert held is not None
    if isinstance(held, np.ndarray):
        assert (held == 1).all()


def test_the_pool_stays_bounded_when_everything_is_held():
    pool = HostPool(2)
    kept = [_fill(pool, i) for i in range(10)]
    assert len(pool.buffers) == 2 and pool.reused == 0
    assert [int(t[0, 0, 0, 0]) for t in kept] == list(range(10))


def test_another_shape_or_dtype_gets_its_own_buffer():
    pool = HostPool(2)
    a = pool.take(SHAPE, torch.float32)
    ptr = a.data_ptr()
    del a
    b = pool.take((1, 3, 4, 4), torch.float32)  # the last batch of an epoch: smaller
    c = pool.take(SHAPE, torch.uint8)
    assert b.shape == (1, 3, 4, 4) and c.dtype == torch.uint8
    assert ptr not in (b.data_ptr(), c.data_ptr())
