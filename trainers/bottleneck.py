"""Where a training run's time went, and what would help: the bottleneck report.

The loop times each step's wait for data (which includes the wait for the batch's copy to the
device) and its compute (forward, backward, optimizer; on a GPU the loss read at each step
synchronises, so wall clock covers the kernels). A run is input-bound when the accelerator
waited for data for more than `INPUT_BOUND` of the time.

The advice is printed by tools/train.py: it names train.py's flags (`--prefetch 4`), each with
the loader option it sets (`prefetch=4`) for a loop of your own around `fit`.
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
    # Where decoding runs (loaders without the attribute: where their batches land).
    decode = getattr(loader, "decode", getattr(loader, "device", "cpu"))
    if kind in ("image", "pointcloud") and decode == "cpu" and _cuda():
        return head + _on_the_gpu(loader, kind)
    if kind == "image" and cfg.normalize:
        return head + ("send uint8 (the loader option normalize=False; train.py always does) "
                       "and normalize on the device: 4x fewer bytes")
    if cfg.prefetch < 4:
        return head + (f"prefetch deeper to absorb jitter: --prefetch 4 (the loader option "
                       f"prefetch=4; {cfg.prefetch} now)")
    if kind == "text":
        return head + ("tokenizing is the cost: --tokenizer bytes (built in) or a "
                       "tokenizer.json (HF tokenizers: batched, in Rust), or longer rows per "
                       "step (--seq-len)")
    if kind == "pointcloud":
        return head + (f"the {cfg.threads} decode threads are saturated: {_more_threads(cfg)}, "
                       "fewer points (--num-points) or a smaller voxel grid (--grid)")
    return head + (f"the {cfg.threads} decode threads are saturated: {_more_threads(cfg)}, "
                   "smaller stored images, or the image_loader options fast_idct=True / "
                   "antialias=False (no train.py flags)")


def _on_the_gpu(loader: Any, kind: str) -> str:
    """Decoding (images) or augmenting (point clouds) on the CPU beside an idle GPU."""
    work = "decode" if kind == "image" else "augment and voxelize"
    flags, options = ["--decode gpu"], ["decode='gpu'"]
    if getattr(loader, "device", "cpu") == "cpu":  # GPU decoding puts the batches there
        flags.insert(0, "--device cuda")
        options.insert(0, "device='cuda'")
    needs = ""
    if getattr(loader, "backend", "dali") == "portable":  # the portable backend: CPU only
        flags.insert(0, "--backend dali")
        options.insert(0, "backend='dali'")
        needs = ", with nvidia-dali-cuda120 installed"
    named = "option" if len(options) == 1 else "options"
    return (f"{work} on the GPU: {' '.join(flags)} (the loader {named} {', '.join(options)}"
            f"{needs}): the CPU works, the GPU idles")


def _more_threads(cfg: Any) -> str:
    from shardflow.loading.options import cores

    here = cores()
    if cfg.threads < here:
        return (f"more threads where this node's {here} cores are not all busy (--loader-threads "
                "N, the loader option threads=N)")
    return f"more cores (all {here} cores here decode already)"


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())
