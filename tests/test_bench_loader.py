"""tools/bench_loader.py end to end on tiny corpora: every modality writes its table, JSON,
markdown and chart, compares equal work, and leaves no work folder behind."""

from __future__ import annotations

import json

import pytest
from conftest import run_tool


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
    if modality == "image":
        assert set(result["images_per_s"]) >= {"shardflow", "DALI by hand"}
        assert all(v > 0 for v in result["ratios"].values())
    else:
        assert set(result["clouds_per_s"]) == {"shardflow", "plain loop"}
        assert result["voxelize"]["points_per_s_per_core"] > 0
    assert out.with_suffix(".md").read_text().strip() in proc.stdout
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert not (tmp_path / "work").exists(), "the benchmark's work folder was left behind"
