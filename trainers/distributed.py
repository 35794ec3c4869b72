"""Distributed training under `torchrun`: one process per device, torch.distributed's DDP.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK for each process; only the command-line tool
reads them (`from_torchrun_env`), and passes the result down explicitly. Backend: NCCL on
GPUs, gloo on the CPU. Gradient compression: trainers/compression.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)
# How long a rank waits at the evaluation barrier for the slowest rank's share.
EVAL_WAIT = timedelta(hours=2)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def from_torchrun_env(env: dict[str, str] | None = None) -> DistInfo:
    """The process's place in a torchrun job (a single process when not under torchrun)."""
    env = dict(os.environ) if env is None else env
    if "WORLD_SIZE" not in env:
        return DistInfo()
    return DistInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))


def init(info: DistInfo, use_cuda: bool) -> None:
    """Join the process group (NCCL with CUDA, gloo otherwise); no-op for one process."""
    if not info.active or dist.is_initialized():
        return
    if use_cuda:
        torch.cuda.set_device(info.local_rank)  # before any CUDA work of this process
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=info.rank,
                            world_size=info.world_size)


def wrap(model: nn.Module, info: DistInfo, device: torch.device,
         compression: str) -> nn.Module:
    """DDP around `model` (unchanged for one process), with its gradient compression
    (trainers/compression.py; `compression_of` finds it again)."""
    if not info.active:
        return model
    from torch.nn.parallel import DistributedDataParallel

    from shardflow.trainers.compression import Compression

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                  else None)
    if compression == "bf16" and device.type != "cuda":
        raise ValueError("--grad-compression bf16 needs CUDA with NCCL (torch's bf16 hook); "
                         "on the CPU (gloo) use fp16, int8, powersgd or none")
    comp = Compression(compression, model)
    comp.register(ddp)
    ddp.shardflow_compression = comp  # type: ignore[assignment]
    return ddp


def compression_of(model: nn.Module) -> Any:
    """The Compression of a model `wrap` made (compiled or not), None for one process."""
    inner = _compiled(model) or model
    return getattr(inner, "shardflow_compression", None)


def wrap_then_compile(model: nn.Module, info: DistInfo, device: torch.device,
                      compression: str, backend: str | None = None) -> nn.Module:
    """DDP first, then torch.compile (with `backend`; None: no compiling). This order lets
    dynamo's DDPOptimizer split the compiled graph at DDP's bucket boundaries, so each
    bucket's all-reduce overlaps the rest of backward; compiling first hides the graph from
    DDP and all-reduces only after the whole backward. `unwrap` finds the bare model either
    way, and checkpoints hold its state (no "module." or "_orig_mod." prefixes)."""
    from shardflow.trainers.models import compile_model

    wrapped = wrap(model, info, device, compression)
    return wrapped if backend is None else compile_model(wrapped, backend)


def _compiled(model: nn.Module) -> nn.Module | None:
    """What torch.compile wrapped (None for a module it did not make)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else None


def is_compiled(model: nn.Module) -> bool:
    """Whether torch.compile wrapped `model`, or the model inside its DDP wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model = model.module
    return _compiled(model) is not None


def distributed_module(model: nn.Module) -> Any:
    """The DistributedDataParallel wrapper of `model` (itself, or inside torch.compile's),
    or None."""
    from torch.nn.parallel import DistributedDataParallel

    while not isinstance(model, DistributedDataParallel):
        inner = _compiled(model)
        if inner is None:
            return None
        model = inner
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP and torch.compile wrappers, in either order (what checkpoints
    hold, so that they load into any of them). Only those wrappers: a model's own submodule
    named `module` is left alone."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        inner = model.module if isinstance(model, DistributedDataParallel) else \
            _compiled(model)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def wait_group(info: DistInfo) -> Any:
    """A gloo group to wait in (None for one process). Collective: every rank builds it, in
    the same order. Ranks that finish their share of the evaluation early wait here, on the
    CPU with a long timeout, and not inside an NCCL collective, whose watchdog would abort
    the job after its own (10 minute) timeout."""
    if not info.active or not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=EVAL_WAIT)


def eval_barrier(group: Any) -> None:
    """Every rank reaches this point (a monitored gloo barrier: one that never comes is
    named in the error after EVAL_WAIT). A no-op without a group."""
    if group is not None:
        dist.monitored_barrier(group, timeout=EVAL_WAIT)


def gather(obj: Any, info: DistInfo) -> list[Any]:
    """`obj` of every rank, in rank order (a one-element list for one process)."""
    if not info.active:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(obj: Any, info: DistInfo) -> list[Any] | None:
    """`obj` of every rank, in rank order, on rank 0 (None on the others): for what only the
    checkpoint's one writer needs, and is too large to hand every rank (a model's size per
    rank, as gradient compression's error feedback is)."""
    if not info.active:
        return [obj]
    out: list[Any] | None = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def sum_over_ranks(values: list[float], info: DistInfo) -> list[float]:
    """Element-wise sums over ranks (NCCL reduces only GPU tensors: the tensor goes there)."""
    if not info.active:
        return values
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.cpu().tolist()


def parameter_digest(model: nn.Module) -> str:
    """A hash of the trainable parameters (not buffers: BatchNorm statistics are per rank
    between DDP's buffer broadcasts)."""
    h = hashlib.sha256()
    for name, p in unwrap(model).named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def finish(info: DistInfo) -> None:
    if info.active and dist.is_initialized():
        dist.destroy_process_group()
