#!/usr/bin/env python3
"""The GPU checks, in one run: the `gpu`-marked tests, then GPU figures as JSON.

    python tools/gpu_check.py --json gpu-report.json      (make gpu-check)

Figures: mixed (nvJPEG) vs CPU decode images/s, a sweep of hw_decoder_load, pinned vs pageable
host-to-device copies, prefetch depth, and the data-stall share of an AMP training step. Without
CUDA it says so and exits 0. Sized to finish well inside 8 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent


def loader_rate(shards: Path, epochs: int = 2, **options: Any) -> float:
    from pipeline import image_loader

    with image_loader(shards, batch_size=128, **options) as loader:
        for _ in loader:  # warm-up epoch
            pass
        start, seen = time.perf_counter(), 0
        for _ in range(epochs):
            for batch in loader:
                seen += len(batch)
        return seen / (time.perf_counter() - start)


def copy_rates(megabytes: int = 256) -> dict[str, float]:
    import torch

    host = torch.empty(megabytes * 2**20, dtype=torch.uint8)
    out = {}
    for name, tensor in (("pageable", host), ("pinned", host.pin_memory())):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()  # the copies are done
        out[f"{name}_GBps"] = 5 * megabytes / 1024 / (time.perf_counter() - start)
    return out


def stall_share(shards: Path) -> dict[str, Any]:
    """A short AMP ResNet run through the real trainer; its bottleneck report."""
    import tempfile

    import torch

    from pipeline.image import ImageConfig, ImageLoader
    from pipeline.shardlist import resolve
    from trainers.image_task import ImageClassification
    from trainers.loop import TrainConfig, Trainer
    from trainers.run import fit

    source = resolve(shards)
    loader = ImageLoader(source, ImageConfig(batch_size=128, device="gpu"), 0, 1)
    task = ImageClassification(len(source.classes or {}) or 10, "small-resnet",
                               torch.device("cuda", loader.cuda_index))
    with tempfile.TemporaryDirectory() as run:
        cfg = TrainConfig(run_dir=Path(run), steps=100, precision="auto")
        summary = fit(Trainer(task, loader, cfg, task.device, {}))
    loader.close()
    return {"precision": summary["precision"], "samples_per_s": summary["samples_per_s"],
            **summary["bottleneck"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=Path("gpu-report.json"))
    p.add_argument("--images", type=int, default=2000)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (the gpu tests are skipped in make test)")
        return 0
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0)}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(ROOT / "tests")])
    report["gpu_tests_exit_code"] = tests.returncode
    shards = make_corpus(Path("gpu-check-work"), args.images)
    report["images_per_s"] = {"cpu_decode": loader_rate(shards, device="cpu"),
                              "mixed_decode": loader_rate(shards, device="gpu")}
    report["hw_decoder_load"] = {str(x): loader_rate(shards, device="gpu", hw_decoder_load=x)
                                 for x in (0.0, 0.35, 0.65, 1.0)}
    report["prefetch"] = {str(d): loader_rate(shards, device="gpu", prefetch=d) for d in (1, 2, 4)}
    report["copies"] = copy_rates()
    report["amp_step"] = stall_share(shards)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 1 if tests.returncode else 0


def make_corpus(work: Path, images: int) -> Path:
    from pipeline.builtin import make_photo_corpus
    from pipeline.convert import ConvertConfig, convert

    if (work / "shards" / "manifest.json").exists():
        return work / "shards"
    folder = make_photo_corpus(work / "photos", count=images)
    convert(ConvertConfig(kind="imagefolder", src=str(folder), out=work / "shards",
                          max_count=250, shuffle_seed=0))
    return work / "shards"


if __name__ == "__main__":
    sys.exit(main())
