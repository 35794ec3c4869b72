"""Benchmark core: alternate the contenders A B A B in one run, report medians and ratios.

The machines are shared and noisy, so an absolute figure means little; a ratio against a
baseline measured in the same run, on the same bytes, does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Timings:
    """Seconds per repeat for each contender, in the order they ran."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)  # CPU-seconds per repeat

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def rate(self, name: str, work: float) -> float:
        """Work units (bytes, images...) per second, from the median time."""
        return work / self.median(name)

    def ratio(self, name: str, baseline: str) -> float:
        """How many times faster `name` is than `baseline` (>1: faster)."""
        return self.median(baseline) / self.median(name)


def alternate(contenders: dict[str, Callable[[], object]], *, repeats: int = 3,
              warmup: int = 1, cpu_clock: Callable[[], float] | None = None) -> Timings:
    """Run every contender `warmup` times untimed, then `repeats` rounds of A B C, A B C...
    With `cpu_clock`, also record the CPU-seconds each run used."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1, warmup >= 0")
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    timings = Timings({name: [] for name in contenders}, {name: [] for name in contenders})
    for _ in range(repeats):
        for name, fn in contenders.items():
            cpu = cpu_clock() if cpu_clock else 0.0
            start = time.perf_counter()
            fn()
            timings.seconds[name].append(time.perf_counter() - start)
            timings.cpu[name].append((cpu_clock() if cpu_clock else 0.0) - cpu)
    return timings
