"""A CPU-offloaded optimizer step: master weights and optimizer state live in host memory.

The accelerator keeps only the working copy of the parameters and their gradients. Each step:

    on the device: unscale (fp16: HostScaler) -> clip -> gradients copied, asynchronously, into
                   pinned host buffers allocated once (`pull_grads`)
    one host sync: the step's finiteness flag (the copies, queued before it, are then done)
    on the host:   the optimizer steps the fp32 master weights (a fused or foreach CPU Adam)
    to the device: the weights copied back asynchronously from pinned memory (`push_params`)

A push from step N reads the pinned masters while the host is free again; the host next writes
them in step N+1's optimizer step, after that step's sync, which waits for the device stream
the push was queued on: so a copy never reads a half-updated master. It gives the same
parameters as the on-device step, to float tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class OffloadedOptimizer:
    """Wraps an optimizer built (by `make`) over host-memory master copies of `model`'s
    trainable parameters. `param_groups` are the master's: schedules act there."""

    def __init__(self, model: nn.Module,
                 make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.pin = any(p.is_cuda for p in self.params)
        self.master = [self._host(p) for p in self.params]
        # Gradient landing buffers, pinned once: asynchronous copies, no allocation per step.
        self.grads = [torch.empty_like(m, pin_memory=self.pin) for m in self.master]
        self.inner = make(self.master)

    def _host(self, p: torch.Tensor) -> torch.Tensor:
        master = torch.empty(p.shape, dtype=torch.float32, pin_memory=self.pin)
        master.copy_(p.detach())
        return master.requires_grad_(True)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def device_grads(self) -> list[torch.Tensor]:
        """The gradients on the device (to unscale and clip before they leave it)."""
        return [p.grad for p in self.params if p.grad is not None]

    def pull_grads(self) -> None:
        """Gradients into the pinned host buffers, queued on the current stream (complete
        once the caller's host sync on that stream returns)."""
        for p, m, g in zip(self.params, self.master, self.grads, strict=True):
            if p.grad is None:
                m.grad = None
                continue
            g.copy_(p.grad.detach(), non_blocking=True)
            m.grad = g

    def step(self) -> None:
        """The host step (call after the sync that completes `pull_grads`), then the push."""
        self.inner.step()
        self.push_params()

    def push_params(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m, non_blocking=True)  # from pinned memory: asynchronous on CUDA

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None  # the pinned buffers stay, reused next step

    def sync_from_model(self) -> None:
        """Master weights from the model's (after loading a checkpoint into the model)."""
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                m.copy_(p.detach().to("cpu", torch.float32))

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
