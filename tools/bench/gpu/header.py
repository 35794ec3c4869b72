"""The report's header: versions, devices, cores, and whether DALI imports."""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any

from shardflow.tools.bench.gpu.context import Ctx


def dali_probe() -> dict[str, Any]:
    try:
        import nvidia.dali as dali
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install
        return {"dali_imports": False, "dali_error": f"{type(exc).__name__}: {exc}"}
    return {"dali_imports": True, "dali_version": getattr(dali, "__version__", "?")}


def cuda_state(cuda_build: bool, available: bool) -> str:
    if available:
        return "CUDA available"
    if not cuda_build:
        return "torch here is a CPU-only build"
    return "torch is a CUDA build but no GPU is visible"


def part_header(ctx: Ctx) -> dict[str, Any]:
    """Versions, devices, cores, and whether DALI imports."""
    import torch

    import shardflow

    build, available = torch.version.cuda is not None, torch.cuda.is_available()
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda_build": build, "cuda_version": torch.version.cuda, "cuda_available": available,
        "cuda_state": cuda_state(build, available), "gpu": None,
        "cpu_count": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
        "dry_run": ctx.dry,
        "shardflow": os.path.dirname(shardflow.__file__)}  # installed, or a checkout's links
    # Exception, not ImportError: a torchvision built for another torch raises RuntimeError
    # ("operator torchvision::nms does not exist") on import.
    with contextlib.suppress(Exception):
        import torchvision

        info["torchvision"] = torchvision.__version__
    if available:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                    capability=f"{props.major}.{props.minor}",
                    gpu_memory_gb=round(props.total_memory / 2**30, 1),
                    cudnn=torch.backends.cudnn.version())
    from shardflow.dali import wheel_for

    # the DALI wheel this torch's CUDA wants (nvidia-dali-cuda130 for CUDA 13 builds)
    return {**info, **dali_probe(), "dali_wheel": wheel_for(torch.version.cuda)}
