"""Mixed precision: one small object for autocast, backward, the optimizer step and its state.

    bf16  autocast to bfloat16 (CPU and GPU); no scaler: bf16 has fp32's exponent range
    fp16  autocast to float16 + GradScaler (CUDA only); overflowed steps are skipped, counted
    fp32  no autocast
    auto  bf16 where the hardware runs it natively (CUDA compute capability >= 8.0, or a CPU
          with AVX512-BF16 or AMX), else fp32; the choice is logged
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)
PrecisionName = Literal["auto", "bf16", "fp16", "fp32"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16, read from the kernel's CPU flags (Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(name: PrecisionName, device: torch.device) -> str:
    if name not in ("auto", "bf16", "fp16", "fp32"):
        raise ValueError(f"precision={name!r}: choose auto, bf16, fp16 or fp32")
    if name == "fp16" and device.type != "cuda":
        raise ValueError("precision='fp16' needs CUDA (GradScaler); on the CPU use bf16 or fp32")
    if name != "auto":
        return name
    if device.type == "cuda":
        native = torch.cuda.get_device_capability(device)[0] >= 8
    else:
        native = cpu_has_native_bf16()
    chosen = "bf16" if native else "fp32"
    log.info("precision auto -> %s (%s)", chosen, "native bf16" if native else "no native bf16")
    return chosen


class Precision:
    """Autocast context, scaled backward and the optimizer step for one precision."""

    def __init__(self, name: PrecisionName, device: torch.device,
                 max_nonfinite: int = 20) -> None:
        self.device = device
        self.name = resolve_precision(name, device)
        self.scaler = torch.amp.GradScaler("cuda") if self.name == "fp16" else None
        self.max_nonfinite, self.nonfinite_in_a_row, self.skipped_steps = max_nonfinite, 0, 0

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if self.name == "fp32":
            yield
            return
        with torch.autocast(self.device.type, dtype=DTYPES[self.name]):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients in true units (before clipping)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when fp16 found inf/NaN gradients and skipped the step."""
        if not self.scaler:
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        stepped = self.scaler.get_scale() >= scale  # the scale drops only on a skipped step
        self.skipped_steps += not stepped
        return stepped

    def check_loss(self, loss: float) -> None:
        """Abort after `max_nonfinite` non-finite losses in a row: the run has diverged."""
        if loss == loss and abs(loss) != float("inf"):
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        if self.nonfinite_in_a_row >= self.max_nonfinite:
            raise FloatingPointError(
                f"{self.nonfinite_in_a_row} non-finite losses in a row with precision "
                f"{self.name}: the run diverged; lower the learning rate or use fp32/bf16")

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scaler": self.scaler.state_dict() if self.scaler else None,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["name"] != self.name:
            raise ValueError(f"checkpoint was trained in {state['name']}, this run uses "
                             f"{self.name}; pass --precision {state['name']} to resume it")
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state["skipped_steps"])
