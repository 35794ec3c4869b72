"""Where a training run's time went, and what would help: the bottleneck report.

The loop times each step's wait for data (which includes the wait for the batch's copy to the
device) and its compute (forward, backward, optimizer; on a GPU the loss read at each step
synchronises, so wall clock covers the kernels). A run is input-bound when the accelerator
waited for data for more than `INPUT_BOUND` of the time.
"""

from __future__ import annotations

from typing import Any

INPUT_BOUND = 0.10


def report(wait_s: float, compute_s: float, loader: Any) -> dict[str, Any]:
    """Shares of the step time and a suggestion with the figures behind it."""
    total = max(wait_s + compute_s, 1e-9)
    wait = wait_s / total
    out: dict[str, Any] = {"data_wait_share": round(wait, 4),
                           "compute_share": round(compute_s / total, 4),
                           "input_bound": wait > INPUT_BOUND}
    out["advice"] = _advice(wait, loader) if out["input_bound"] else (
        f"compute-bound: the loader kept up (the step waited for data {wait:.0%} of the time)")
    return out


def _advice(wait: float, loader: Any) -> str:
    cfg, kind = getattr(loader, "cfg", None), getattr(loader, "kind", "")
    head = f"input-bound: the step waited for data {wait:.0%} of the time; "
    if cfg is None:
        return head + "make the loader faster (more workers or threads)"
    if kind in ("image", "pointcloud") and getattr(loader, "device", "cpu") == "cpu" \
            and _cuda():
        work = "decode" if kind == "image" else "augment and voxelize"
        return head + f"{work} on the GPU (device='gpu'): the CPU works, the GPU idles"
    if kind == "image" and cfg.normalize:
        return head + "send uint8 (normalize=False) and normalize on the device: 4x fewer bytes"
    if cfg.prefetch < 4:
        return head + f"prefetch deeper (prefetch={cfg.prefetch} now; try 4) to absorb jitter"
    if kind == "text":
        return head + ("tokenizing is the cost: use the built-in bytes or an HF tokenizer.json "
                       "(batched, in Rust), or longer rows (seq_len) per step")
    if kind == "pointcloud":
        return head + (f"the {cfg.threads} threads are saturated: fewer num_points, a smaller "
                       "grid, or a GPU loader (device='gpu') voxelizing there")
    return head + (f"the loader's {cfg.threads} decode threads are saturated: add cores, "
                   "shrink the input images, or use fast_idct=True / antialias=False")


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())
