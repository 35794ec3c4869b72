"""tools/bench_loader.py end to end on tiny corpora: every modality writes its table, JSON,
markdown and chart, compares equal work, and leaves no work folder behind."""

from __future__ import annotations

import json

import pytest
from conftest import run_tool

from pipeline.loading.readers import dali_importable


@pytest.mark.parametrize("modality,size", [("image", ["--images", 24]),
                                           ("pointcloud", ["--clouds", 60])])
def test_bench_loader_figures(tmp_path, modality, size):
    out = tmp_path / "bench.json"
    proc = run_tool("bench_loader", "--modality", modality, *size, "--repeats", 1,
                    "--batch-size", 8, "--epochs", 2, "--work", tmp_path / "work", "--json",
                    out, "--plot", tmp_path / "bench.png", check=True)
    result = json.loads(out.read_text())
    figures = result if modality == "image" else result["shardflow"]
    assert figures["time_to_first_batch_s"] > 0 and figures["overlap"] > 0
    assert len(figures["rss_mb_after_each_epoch"]) == 2
    _check_loader_figures(figures, epochs=2)
    _check_rates(result, modality)
    if modality == "image":
        # The portable backend is always measured; the DALI baselines where DALI imports.
        dali = {"DALI by hand", "DALI decode only"} if dali_importable() else set()
        assert set(result["images_per_s"]) >= {"shardflow", "shardflow portable", *dali}
        assert result["ratios"]["shardflow portable/tv"] > 0
        assert all(v > 0 for v in result["ratios"].values())
    else:
        assert set(result["clouds_per_s"]) == {"shardflow", "plain loop"}
        assert result["voxelize"]["points_per_s_per_core"] > 0
    assert out.with_suffix(".md").read_text().strip() in proc.stdout
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert not (tmp_path / "work").exists(), "the benchmark's work folder was left behind"


# Short names the image ratios use for their baselines (tools/bench_loader.py's BASELINES).
_ALIASES = {"tv": "torchvision-style uint8", "wds": "webdataset + PIL", "dali": "DALI by hand",
            "decode": "DALI decode only", "canonical float": "torchvision-style float"}


def _check_loader_figures(figures: dict, epochs: int) -> None:
    """What loader_figures' arithmetic guarantees, whatever the machine's speed."""
    # The timed epoch sleeps, in total, exactly as long as the loader's epoch took: it can
    # only take longer (1.0: fully overlapped; ~2: serial).
    assert figures["overlap"] >= 1.0, figures
    rss = figures["rss_mb_after_each_epoch"]
    assert len(rss) == epochs and all(v > 0 for v in rss)
    assert figures["rss_growth_mb_per_epoch"] == pytest.approx(
        (rss[-1] - rss[0]) / (epochs - 1), abs=0.011)
    # The peak is at least every RSS sample, up to how the two are read: ru_maxrss and
    # /proc/self/statm come from per-CPU kernel counters that lag (measured: up to 0.4 MB
    # apart), and peak_rss_mb is ru_maxrss (KiB) / 1e3, 2.4% low (pipeline/bench/core.py).
    assert figures["peak_rss_mb"] >= 0.95 * max(rss), figures


def _check_rates(result: dict, modality: str) -> None:
    """Every rate, ratio and per-item cost is over the same contenders, and each ratio is
    the quotient of the two rates it names (to their rounding)."""
    unit = "images" if modality == "image" else "clouds"
    rates, work = result[f"{unit}_per_s"], result[unit]
    assert set(result[f"cpu_s_per_{unit[:-1]}"]) == set(rates)
    assert all(v > 0 for v in rates.values()) and work == (24 if unit == "images" else 60)
    assert result["batch_size"] == 8
    if modality == "image":
        ratios = result["ratios"]
        # shardflow (uint8) against every baseline: each one measured has its ratio
        against = {_ALIASES.get(b, b) for a, b in (k.split("/") for k in ratios)
                   if a == "shardflow"}
        assert {n for n in rates if not n.startswith("shardflow")} <= against, ratios
    else:
        ratios = {"shardflow/plain loop": result["ratio shardflow/plain loop"]}
        points = result["points_per_cloud"]
        for name, rate in rates.items():  # the same medians, counted in points
            assert result["points_per_s"][name] == pytest.approx(rate * points, rel=1e-3)
        v = result["voxelize"]
        assert v["batch"] == [8, result["num_points"]] and v["grid"] == result["grid"]
        assert v["ratio_to_reference"] == pytest.approx(
            v["points_per_s_per_core"] / v["reference_points_per_s_per_core"], abs=6e-4)
    for key, ratio in ratios.items():
        ours, base = key.split("/")
        a, b = rates[ours], rates[_ALIASES.get(base, base)]
        slack = 5e-4 + (a / b) * (0.05 / a + 0.05 / b) * 1.01  # rates to 0.1, ratios to 0.001
        assert abs(ratio - a / b) <= slack, (key, ratio, a, b)


class _Clock:
    """Stands in for `time` in pipeline.bench.core: sleeping advances it, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _TimedLoader:
    """`batches` per pass, each `cost` seconds of the clock, the very first `cold` more. A
    `background` loader produces the next batch while the consumer holds the last one."""

    def __init__(self, clock: _Clock, batches: int, cost: float, cold: float,
                 background: bool) -> None:
        self.clock, self.batches, self.cost, self.cold = clock, batches, cost, cold
        self.background, self.closed = background, False

    def __iter__(self):
        ready = self.clock.now + self.cost + self.cold
        self.cold = 0.0
        for i in range(self.batches):
            if self.background:
                self.clock.now = max(self.clock.now, ready)
            else:
                self.clock.now = ready if i == 0 else self.clock.now + self.cost
            handed = self.clock.now
            yield i
            ready = handed + self.cost

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("background, overlap", [(False, 2.0), (True, 1.25)])
def test_loader_figures_measure_first_batch_and_overlap(monkeypatch, background, overlap):
    """On a clock the test drives: the first batch of a new loader costs its start-up and
    one batch; a serial loader's overlap is 2, one that prepares the next batch while the
    step runs reaches 1 + 1/batches (its first batch of a pass is never prefetched)."""
    from pipeline.bench import core

    clock = _Clock()
    monkeypatch.setattr(core, "time", clock)
    resident = iter([30.0, 31.0, 33.0])  # MB after each epoch
    monkeypatch.setattr(core, "rss_mb", lambda: next(resident))
    loaders: list[_TimedLoader] = []

    def make() -> _TimedLoader:
        loaders.append(_TimedLoader(clock, batches=4, cost=0.25, cold=1.5,
                                    background=background))
        return loaders[-1]

    figures = core.loader_figures(make, epochs=3)
    assert len(loaders) == 1 and loaders[0].closed
    assert figures["time_to_first_batch_s"] == 1.75
    assert figures["overlap"] == overlap
    assert figures["rss_mb_after_each_epoch"] == [30.0, 31.0, 33.0]
    assert figures["rss_growth_mb_per_epoch"] == 1.5
    _check_loader_figures(figures, epochs=3)
