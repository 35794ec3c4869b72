"""Mixed precision: one small object for autocast, backward, the optimizer step and its state.

    bf16  autocast to bfloat16 (CPU and GPU); no scaler: bf16 has fp32's exponent range
    fp16  autocast to float16 + loss scaling (CUDA only); overflowed steps are skipped, counted
    fp32  no autocast
    auto  bf16 where the hardware runs it natively (CUDA compute capability >= 8.0, or a CPU
          with AVX512-BF16 or AMX), else fp32; the choice is logged. An explicit bf16 that
          the hardware only emulates is allowed with a warning that gives its measured cost.

Loss scaling: torch's GradScaler when the optimizer steps on the device. The optimizer is
fused there (loop.make_optimizer), so GradScaler hands it `found_inf` and the step is skipped
inside the kernel: no host sync at all (a foreach optimizer would make GradScaler read the
flag with `.item()` every step). With the optimizer offloaded to host memory, `HostScaler`:
gradients are unscaled and checked on the GPU, before they leave it, and the scale is kept on
the host, updated from the step's one synchronised finiteness flag. Skipped steps are counted
on the device and read only when asked for (log steps, checkpoints).
"""

from __future__ import annotations

import contextlib
import logging
import time
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


def native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    return cpu_has_native_bf16()


def emulated_bf16_cost(repeats: int = 5) -> float:
    """How many times slower a bf16 matmul runs than fp32 on this CPU (a 256x256 product,
    the best of `repeats`): about 1 where bf16 is native, ~100-200 where it is emulated."""
    a = torch.randn(256, 256)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            x @ x
            best = min(best, time.perf_counter() - start)
        times[dtype] = best
    return times[torch.bfloat16] / max(times[torch.float32], 1e-9)


def resolve_precision(name: PrecisionName, device: torch.device) -> str:
    if name not in ("auto", "bf16", "fp16", "fp32"):
        raise ValueError(f"precision={name!r}: choose auto, bf16, fp16 or fp32")
    if name == "fp16" and device.type != "cuda":
        raise ValueError("precision='fp16' needs CUDA (GradScaler); on the CPU use bf16 or fp32")
    if name == "bf16" and not native_bf16(device):
        _warn_emulated(device)
    if name != "auto":
        return name
    native = native_bf16(device)
    chosen = "bf16" if native else "fp32"
    log.info("precision auto -> %s (%s)", chosen, "native bf16" if native else "no native bf16")
    return chosen


def _warn_emulated(device: torch.device) -> None:
    if device.type == "cuda":
        log.warning("precision='bf16' on %s (compute capability < 8.0): bf16 is not native "
                    "there; fp16 or fp32 will be faster", torch.cuda.get_device_name(device))
        return
    log.warning("precision='bf16' on a CPU without AVX512-BF16 or AMX: bf16 is emulated here "
                "and a bf16 matmul measured %.0fx slower than fp32; use --precision fp32 (or "
                "auto, which never picks an emulated precision)", emulated_bf16_cost())


class HostScaler:
    """fp16 loss scaling driven from the host, for an optimizer offloaded to host memory:
    the scale is a host number (no device read to know it), gradients are unscaled on the
    device before they are copied out, and `update(finite)` takes the step's finiteness flag,
    already synchronised by the caller. Same rule as torch's GradScaler: halve on overflow,
    double after `growth_interval` clean steps."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale, self.growth_interval, self.growth_tracker = init_scale, growth_interval, 0

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale, self.growth_tracker = self.scale * 0.5, 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale, self.growth_tracker = self.scale * 2.0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.growth_tracker = float(state["scale"]), int(state["growth_tracker"])
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))


class Precision:
    """Autocast context, scaled backward and the optimizer step for one precision.
    `offloaded`: the optimizer steps in host memory (fp16 then scales with a HostScaler)."""

    def __init__(self, name: PrecisionName, device: torch.device,
                 max_nonfinite: int = 20, offloaded: bool = False) -> None:
        self.device = device
        self.name = resolve_precision(name, device)
        fp16 = self.name == "fp16"
        self.scaler = torch.amp.GradScaler(device.type) if fp16 and not offloaded else None
        self.host_scaler = HostScaler() if fp16 and offloaded else None
        self.max_nonfinite, self.nonfinite_in_a_row = max_nonfinite, 0
        # fp16 steps skipped for overflow: counted where the flag is (the device for
        # GradScaler), read only when asked for.
        self._skipped: Any = 0

    @property
    def scaled(self) -> bool:
        return self.scaler is not None or self.host_scaler is not None

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)  # a host sync when counted on the device: log steps only

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if self.name == "fp32":
            yield
            return
        with torch.autocast(self.device.type, dtype=DTYPES[self.name]):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler:
            loss = self.scaler.scale(loss)
        elif self.host_scaler:
            loss = loss * self.host_scaler.scale
        loss.backward()

    def unscale(self, optimizer: Any, grads: list[torch.Tensor] | None = None) -> None:
        """Gradients in true units (before clipping): the optimizer's (GradScaler), or
        `grads` on the device before they are offloaded (HostScaler)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)
        elif self.host_scaler and grads is not None:
            self.host_scaler.unscale_(grads)

    def step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> None:
        """fp16 on the device: the scaler steps unless a gradient overflowed (decided on the
        device by a fused optimizer, else by a host read of the flag), then updates the
        scale; `norm` (of the unscaled gradients) is non-finite exactly when it skipped, so
        the count stays on the device."""
        assert self.scaler is not None
        self.scaler.step(optimizer)
        self.scaler.update()
        self._skipped = self._skipped + (~torch.isfinite(norm)).int()

    def host_update(self, finite: bool) -> None:
        """HostScaler: the step's synchronised finiteness flag decides the scale."""
        assert self.host_scaler is not None
        self.host_scaler.update(finite)
        self._skipped = self._skipped + (not finite)

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
        scaler = self.scaler or self.host_scaler
        return {"name": self.name, "scaler": scaler.state_dict() if scaler else None,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["name"] != self.name:
            raise ValueError(f"checkpoint was trained in {state['name']}, this run uses "
                             f"{self.name}; pass --precision {state['name']} to resume it")
        scaler = self.scaler or self.host_scaler
        if scaler and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        self._skipped = int(state["skipped_steps"])
