"""A CPU-offloaded optimizer step: master weights and optimizer state live in host memory.

The accelerator keeps only the working copy of the parameters and their gradients; each step
copies the gradients to host memory, steps the optimizer there (fp32 master weights, Adam's
moments: the bulk of a large model's optimizer memory) and copies the weights back. It gives
the same parameters as the on-device step, to float tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class OffloadedOptimizer:
    """Wraps an optimizer built (by `make`) over host-memory master copies of `model`'s
    trainable parameters. `param_groups` are the master's: schedules and clipping act there."""

    def __init__(self, model: nn.Module,
                 make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        pin = any(p.is_cuda for p in self.params)
        self.master = [self._host(p, pin) for p in self.params]
        self.inner = make(self.master)

    @staticmethod
    def _host(p: torch.Tensor, pin: bool) -> torch.Tensor:
        master = p.detach().to("cpu", torch.float32, copy=True)
        return (master.pin_memory() if pin else master).requires_grad_(True)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def pull_grads(self) -> None:
        """Gradients to host memory (before unscaling and clipping, which act there)."""
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32)

    def step(self) -> None:
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m, non_blocking=True)  # from pinned memory: asynchronous on CUDA

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    def sync_from_model(self) -> None:
        """Master weights from the model's (after loading a checkpoint into the model)."""
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                m.copy_(p.detach().to("cpu", torch.float32))

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
