"""The parts of `shardflow gpu-check`, most valuable first, with their default timeouts (PARTS:
350 s in all, plus HEADER_TIMEOUT_S, 20 s, for the header: 370 s, within BUDGET_S, the 6.25
minutes of one command on a lent GPU machine that the check may take; on one GPU without DALI,
dali is skipped at once and ranks in seconds). The run as a whole has that budget (--budget):
a part never gets more than what is left of it, and one that cannot start (less left than
MIN_START_S, or than its own timeout if that is smaller) is recorded as skipped:

  delivery         correctness: the text loader's batches delivered to CUDA equal the CPU
                   loader's bit for bit, and DeviceCopier's uint8 batches (pinned host memory ->
                   side stream -> ready event) equal the host tensors, also normalized (within
                   1e-5, relative), over >= 150 batches each while another thread allocates,
                   fills, frees and multiplies on the default stream and the copier's stream is
                   stalled now and then. Status "failed" on any mismatch: the script exits 1.
  amp_step         samples/s of a ResNet-50 (trainers/models.py's own: no torchvision
                   needed) SGD step (channels_last, batch --amp-batch) under
                   bf16 autocast and fp16 autocast + GradScaler (a plain loop on torch.amp), and
                   the data-stall share of the loop when a CPU thread feeds uint8 batches
                   through DeviceCopier.
  copies           pinned vs pageable host-to-device GB/s; side-stream copies overlapped with
                   matmuls on the default stream (each alone, then both).
  offload          shardflow.trainers.loop.Trainer steps with the offloaded optimizer (master
                   weights and AdamW state in host memory) vs on the device, fp16 and bf16:
                   loss trajectories and steps/s.
  ddp              DDP over NCCL with one process, through shardflow.trainers.distributed.wrap with
                   every compression mode (fp16, bf16, int8, powersgd:1): each hook runs on
                   every step, its payload against fp32's, gradients against no compression.
  checkpointing    peak CUDA memory of the small ResNet with and without activation
                   checkpointing, same batch; gradients and BatchNorm statistics compared.
  text_pointcloud  GPT-style (clm) and BERT-style (mlm) steps of shardflow.trainers.text_task fed
                   by the text loader on the GPU (samples/s); voxelize on the GPU in a side stream
                   (points/s), as on the CPU (occupancy equal, pillars within 1e-5);
                   LiDAR scenes (per_point_labels, voxel rows) on the device equal to the
                   CPU loader's, and segvoxels there equal to it on the CPU ("failed"
                   otherwise), and segvoxels' points/s there.
  dali             with DALI only: CPU vs mixed (nvJPEG) decode images/s and a hw_decoder_load
                   sweep (0, the default 0.65, 1; and how long each stage took); the two
                   decodes' eval batches: the same keys and labels, pixels within
                   PIXELS_APART levels on average ("failed" otherwise); on 3000-4000 px
                   photos, the portable
                   backend's scaled decode beside DALI's CPU and nvJPEG decodes (whether
                   backend="auto" should leave DALI on a GPU too); "skipped" when nvidia.dali
                   does not import.
  sync_debug       host syncs counted by torch.cuda.set_sync_debug_mode("warn") over Trainer
                   steps (fp16 and bf16, grad_accum 2, after two warm-up steps): "failed"
                   unless there are none (the fused optimizer reads found_inf on the device).
  compile          torch.compile (inductor) over one-process DDP (wrapped in that order) of
                   the small ResNet with activation checkpointing, against eager: compile
                   time, speed-up, and the parameters after the same steps ("failed" when
                   they land farther apart than 5% of how far training moved them).
  ranks            two processes over NCCL (skipped with one GPU): Trainer in DDP with
                   grad_accum 2 all-reduces only on optimizer steps, both ranks end with the
                   same parameters, an uneven evaluation (3 batches and 1) is combined after
                   the gloo barrier into the metrics of one process; all-reduce bus GB/s.
  ops              shardflow.ops on CUDA against the CPU (augment.py): a RandAugment recipe,
                   mixup/cutmix, masks and point ops, host syncs counted ("failed" unless
                   none), images/s; image_loader's augment, batch_augment and views on the
                   device against its CPU batches.
  pipeline         a shardflow.Pipeline (image + caption tokens + JSON + depth, a flip and an
                   affine) delivered to the device against the same pipeline on the CPU: keys,
                   tokens and JSON equal, pixels and depth within tolerance ("failed"
                   otherwise); host syncs counted; batches/s.

A part is `run(ctx) -> dict`: a JSON-able result with "key" (its key figures) and "status"
where it is not "ok". Where they live: context.py (Ctx, Sizes FULL/DRY, shared helpers),
header.py (the header), delivery.py (delivery, copies), amp.py (amp_step), training.py (offload,
ddp, checkpointing), modalities.py (text_pointcloud, dali), steps.py (sync_debug, compile),
ranks.py (ranks), augment.py (ops), pipelines.py (pipeline). Importing any of them imports
neither torch nor DALI: each part imports what it needs when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardflow.tools.bench.gpu.amp import part_amp_step
from shardflow.tools.bench.gpu.augment import part_ops
from shardflow.tools.bench.gpu.context import Ctx, new_ctx
from shardflow.tools.bench.gpu.delivery import part_copies, part_delivery
from shardflow.tools.bench.gpu.header import part_header
from shardflow.tools.bench.gpu.modalities import part_dali, part_text_pointcloud
from shardflow.tools.bench.gpu.pipelines import part_pipeline
from shardflow.tools.bench.gpu.ranks import part_ranks
from shardflow.tools.bench.gpu.steps import part_compile, part_sync_debug
from shardflow.tools.bench.gpu.training import part_checkpointing, part_ddp, part_offload

__all__ = ["BUDGET_S", "HEADER_TIMEOUT_S", "MIN_START_S", "PARTS", "Ctx", "PartSpec", "new_ctx",
           "run_part"]

HEADER_TIMEOUT_S = 20.0  # reading the header (torch and DALI imports, CUDA init): not scaled
# The whole run's default wall-clock limit, header and every part's start-up included: one
# command on a lent GPU machine gets about 10 minutes with its own start; the check keeps
# 6.25, and the gpu tests run in what is left (tests/README.md).
BUDGET_S = 375.0
# Less than this left of the budget (times --timeout-scale; or the part's own timeout, if
# smaller), a part is not started: its process could not even import torch and start CUDA.
MIN_START_S = 10.0


@dataclass(frozen=True)
class PartSpec:
    run: Callable[[Ctx], dict[str, Any]]
    timeout_s: float  # on the H200, including the subprocess's imports and CUDA start
    needs_dali: bool = False


PARTS: dict[str, PartSpec] = {
    "delivery": PartSpec(part_delivery, 35),
    "amp_step": PartSpec(part_amp_step, 45),
    "copies": PartSpec(part_copies, 15),
    "offload": PartSpec(part_offload, 20),
    "ddp": PartSpec(part_ddp, 20),
    "checkpointing": PartSpec(part_checkpointing, 20),
    "text_pointcloud": PartSpec(part_text_pointcloud, 35),
    "dali": PartSpec(part_dali, 35, needs_dali=True),
    "sync_debug": PartSpec(part_sync_debug, 20),
    "compile": PartSpec(part_compile, 45),  # most of it inductor's compile
    "ranks": PartSpec(part_ranks, 25),
    "ops": PartSpec(part_ops, 20),
    "pipeline": PartSpec(part_pipeline, 15),
}  # 350 s in all, plus HEADER_TIMEOUT_S: 370 s, within BUDGET_S (tests/test_gpu_check.py)


def run_part(name: str, ctx: Ctx) -> dict[str, Any]:
    """Run the part `name` ("header", or a name in PARTS) in this process; its result."""
    return (part_header if name == "header" else PARTS[name].run)(ctx)
