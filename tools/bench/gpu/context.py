"""What every GPU check runs with: the sizes (FULL on the GPU machine, DRY on a small CPU), the
context of a part (device, sizes, work folder), and the helpers the parts share: synchronizing,
timing, the consumer side of a device copy, pooled image batches, the device copier, a small
text corpus in shards, and n batches from a loader.

torch and the project's loaders are imported inside the functions that use them: importing this
module stays light (a stand-in run of tools/gpu_check.py never imports torch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
POOL = 4  # distinct random image batches cycled (and offset) by the producers


@dataclass(frozen=True)
class Sizes:
    """Every size the parts use; FULL on the GPU machine (10-45 s a part, within the
    timeouts of tools/bench/gpu's PARTS: 6 minutes in all), DRY on a small CPU."""

    min_batches: int = 150  # delivery: each of its three checks must compare at least this many
    text_docs: int = 600  # about 150 batches a pass
    text_batch: int = 16
    text_seq: int = 128
    text_passes: int = 2
    image_batch: int = 64
    image_side: int = 224
    image_batches: int = 150
    noise_matmul: int = 4096
    noise_mb: tuple[int, ...] = (64, 256, 1024)
    stall_every: int = 8  # delivery: a ~20 ms sleep queued on the copier's stream this often
    stall_cycles: int = 40_000_000
    amp_model: str = "resnet50-local"  # trainers/models.py: needs no torchvision
    amp_batch: int = 256
    amp_side: int = 224
    amp_classes: int = 1000
    amp_warmup: int = 5
    amp_steps: int = 15
    stall_steps: int = 20
    copy_mb: int = 256
    copy_repeats: int = 5
    overlap_n: int = 20
    overlap_chunk_mb: int = 64
    overlap_matmul: int = 8192
    offload_width: int = 1024
    offload_layers: int = 4
    offload_batch: int = 512
    offload_steps: int = 30
    ckpt_batch: int = 256
    ckpt_side: int = 224
    lm_docs: int = 600
    lm_batch: int = 64
    lm_seq: int = 256
    lm_shape: dict[str, int] = field(default_factory=lambda: {"width": 512, "layers": 6,
                                                              "heads": 8})
    lm_warmup: int = 5
    lm_steps: int = 30
    points_batch: int = 32
    points_n: int = 100_000
    voxel_grid: int = 64
    voxel_reps: int = 20
    dali_images: int = 192  # 3 batches of 64 a pass
    dali_batch: int = 64
    large_images: int = 12  # 3000-4000 px photos (make_large_photos), 3 of them distinct
    large_distinct: int = 3
    convert_workers: int = 8
    sync_steps: int = 4  # optimizer steps (8 micro-steps) under CUDA's sync debug mode
    sync_batch: int = 64
    sync_side: int = 64
    compile_steps: int = 8
    compile_batch: int = 128
    compile_side: int = 64
    nccl_mb: int = 256


FULL = Sizes()
DRY = Sizes(min_batches=1, text_docs=40, text_batch=4, text_seq=32, text_passes=1,
            image_batch=4, image_side=16, image_batches=12, noise_matmul=64, noise_mb=(1, 2),
            amp_model="resnet50-local", amp_batch=2, amp_side=32, amp_classes=10, amp_warmup=1,
            amp_steps=1, stall_steps=2, copy_mb=4, copy_repeats=2, overlap_n=2,
            overlap_chunk_mb=1, overlap_matmul=64, offload_width=32, offload_layers=2,
            offload_batch=16, offload_steps=5, ckpt_batch=2, ckpt_side=16, lm_docs=40,
            lm_batch=4, lm_seq=32, lm_shape={"width": 32, "layers": 1, "heads": 2},
            lm_warmup=1, lm_steps=3, points_batch=2, points_n=1000, voxel_grid=8,
            voxel_reps=2, dali_images=16, dali_batch=8, large_images=4, large_distinct=2,
            convert_workers=1, sync_steps=1,
            sync_batch=2, sync_side=16, compile_steps=3, compile_batch=2, compile_side=16,
            nccl_mb=1)


@dataclass(frozen=True)
class Ctx:
    """What a part runs with: where (CUDA, or the CPU in a dry run), sizes, its work folder."""

    dry: bool
    device: torch.device
    work: Path
    sizes: Sizes
    amp_batch: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def loader_device(self) -> str:
        return "gpu" if self.cuda else "cpu"

    @property
    def copier_device(self) -> Any:
        return ("cuda", self.device.index or 0) if self.cuda else "cpu"


def new_ctx(dry: bool, work: Path, amp_batch: int | None) -> Ctx:
    """The context of a part: CUDA device 0 where it is available (and this is no dry run),
    else the CPU; DRY sizes in a dry run, else FULL; `amp_batch` overrides amp_step's batch."""
    import torch

    cuda = torch.cuda.is_available() and not dry
    sizes = DRY if dry else FULL
    return Ctx(dry=dry, device=torch.device("cuda", 0) if cuda else torch.device("cpu"),
               work=work, sizes=sizes, amp_batch=amp_batch or sizes.amp_batch)


def sync(ctx: Ctx) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def on_consumer_stream(ctx: Ctx, ready: Any, *tensors: torch.Tensor) -> None:
    """What a loader does before handing out a batch: wait for the copier's event, and tell
    the caching allocator the tensors are used on this stream too."""
    import torch

    if ready is None:
        return
    stream = torch.cuda.current_stream(ctx.device)
    stream.wait_event(ready)
    for tensor in tensors:
        tensor.record_stream(stream)


def image_pool(batch: int, side: int) -> torch.Tensor:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (POOL, batch, 3, side, side), dtype=torch.uint8,
                         generator=generator)


def pool_batch(pool: torch.Tensor, i: int) -> torch.Tensor:
    """Batch i: a pool entry plus i (uint8 wraps), so no two of 256 consecutive batches match."""
    return pool[i % len(pool)].add(i % 256)


def device_copier() -> Any:
    """The DeviceCopier class, wherever it lives (shardflow.loading.delivery; prefetch before).
    Only its public calls are used: copier(image, label) -> (image, label, ready),
    copier.pinned(array), copier.move(*tensors), copier.stream."""
    try:
        from shardflow.loading.delivery import DeviceCopier
    except ImportError:
        from shardflow.loading.prefetch import DeviceCopier  # type: ignore[attr-defined,no-redef]
    return DeviceCopier


def text_shards(root: Path, docs: int, workers: int = 1) -> Path:
    """A text corpus converted to shards, as tests/test_text_loader.py builds one."""
    from shardflow.builtin import make_text_corpus
    from shardflow.convert import ConvertConfig, convert

    folder = make_text_corpus(root / "docs", docs=docs)
    convert(ConvertConfig(kind="text", src=str(folder), out=str(root / "shards"), max_count=100,
                          workers=workers))
    return root / "shards"


def take(loader: Any, n: int) -> Iterator[Any]:
    """n batches from `loader`, starting another pass whenever one ends."""
    given = 0
    while given < n:
        before = given
        for batch in loader:
            yield batch
            given += 1
            if given >= n:
                return
        if given == before:
            raise RuntimeError("the loader gave no batches in a whole pass")


def timed(ctx: Ctx, work: Callable[[], Any]) -> float:
    sync(ctx)
    start = time.perf_counter()
    work()
    sync(ctx)
    return time.perf_counter() - start
