"""Benchmark core: alternate the contenders A B A B in one run, report medians and ratios.

The machines are shared and noisy, so an absolute figure means little; a ratio against a
baseline measured in the same run, on the same bytes, does.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timings:
    """Seconds per repeat for each contender, in the order they ran."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)  # CPU-seconds per repeat
    # What each timed run returned (an epoch's images, clouds...): a rate is work / time, so a
    # contender that reads half the corpus would read as twice as fast
    counts: dict[str, list[object]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def rate(self, name: str, work: float) -> float:
        """Work units (bytes, images...) per second, from the median time."""
        return work / self.median(name)

    def ratio(self, name: str, baseline: str) -> float:
        """How many times faster `name` is than `baseline` (>1: faster): the median over the
        rounds of baseline time / name time, each pair from the same round. These machines
        drift within a run (repeats of one contender measured 0.50-0.79 s in a row), and a
        ratio of two medians mixes rounds far apart; a round's pair ran seconds apart."""
        pairs = zip(self.seconds[baseline], self.seconds[name], strict=True)
        return statistics.median(b / max(n, 1e-12) for b, n in pairs)


def alternate(contenders: dict[str, Callable[[], object]], *, repeats: int = 3,
              warmup: int = 1, cpu_clock: Callable[[], float] | None = None,
              expect: int | None = None) -> Timings:
    """Run every contender `warmup` times untimed, then `repeats` rounds of A B C, A B C...
    With `cpu_clock`, also record the CPU-seconds each run used. With `expect`, every run
    (the warm-ups too) must return exactly that count, or the benchmark stops naming the
    contender: a rate is only comparable over the same work."""
    from tqdm import tqdm

    from shardflow.tools.util import bar_off

    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1, warmup >= 0")
    # On stderr: what is running now (the figures go to stdout). No monitor thread: it would
    # outlive the benchmark.
    tqdm.monitor_interval = 0
    bar = tqdm(total=len(contenders) * (warmup + repeats), unit="run", leave=False,
                disable=bar_off(False))
    try:
        for name, fn in contenders.items():
            for _ in range(warmup):
                bar.set_description(f"warm-up {name}")
                _check_count(name, fn(), expect)
                bar.update()
        timings = Timings(*({name: [] for name in contenders} for _ in range(3)))  # type: ignore[arg-type]
        for _ in range(repeats):
            for name, fn in contenders.items():
                bar.set_description(name)
                cpu = cpu_clock() if cpu_clock else 0.0
                start = time.perf_counter()
                count = fn()
                timings.seconds[name].append(time.perf_counter() - start)
                timings.counts[name].append(_check_count(name, count, expect))
                timings.cpu[name].append((cpu_clock() if cpu_clock else 0.0) - cpu)
                bar.update()
    finally:
        bar.close()
    return timings


def _check_count(name: str, count: object, expect: int | None) -> object:
    if expect is not None and count != expect:
        raise RuntimeError(f"benchmark contender {name!r} read {count} items of {expect} in an "
                           "epoch: its rate would not be over the same work as the others'")
    return count


def loader_figures(make: Callable[[], Any], epochs: int) -> dict[str, Any]:
    """The figures of BENCHMARKS.md that need one loader alone, for any modality:
    - time to first batch of a new loader;
    - overlap: an epoch with a stand-in accelerator step (a sleep, no CPU) as long as the
      loader's mean batch time, over max(total step time, loader epoch time); 1.0 is perfect;
    - resident memory after each of `epochs` epochs (garbage collected first), and its growth.
    """

    loader = make()
    try:
        start = time.perf_counter()
        batches = iter(loader)
        next(batches)
        first = time.perf_counter() - start
        for _ in batches:  # finish the epoch
            pass
        start = time.perf_counter()
        count = sum(1 for _ in loader)
        epoch_s = time.perf_counter() - start
        step = epoch_s / max(count, 1)
        start = time.perf_counter()
        for _ in loader:
            time.sleep(step)
        overlap = (time.perf_counter() - start) / max(step * count, epoch_s)
        rss = []
        for _ in range(epochs):
            for _ in loader:
                pass
            gc.collect()  # count what is kept, not garbage not yet collected
            rss.append(round(rss_mb(), 1))
    finally:
        loader.close()
    return {"time_to_first_batch_s": round(first, 3), "overlap": round(overlap, 3),
            # ru_maxrss is in KiB on Linux; the RSS samples are in MB (1e6 bytes)
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
                                 1),
            "rss_mb_after_each_epoch": rss,
            "rss_growth_mb_per_epoch": round((rss[-1] - rss[0]) / max(len(rss) - 1, 1), 2)}


def cpu_seconds() -> float:
    """CPU time of this process, its finished children and its live worker processes
    (persistent DataLoader workers never finish during a benchmark)."""
    import multiprocessing

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    live = sum(_proc_cpu(p.pid) for p in multiprocessing.active_children() if p.pid)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + live


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
