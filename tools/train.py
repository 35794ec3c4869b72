#!/usr/bin/env python3
"""Train a task on shards; running the same command again resumes from the run folder.

    shardflow train --task image --data shards/train --out runs/r1 --steps 300
    shardflow train --task image --data shards/train --eval-data shards/val --epochs 2
    shardflow train --task text --objective clm --data shards/text --out runs/t1 --steps 300
    shardflow train --task pointcloud --model voxnet --data shards/pc --out runs/p1 --epochs 5
    shardflow train --task pointcloud-seg --model bev --data shards/kitti --out s1 --epochs 5
    shardflow train --task ctr --model dlrm --data shards/criteo --out runs/c1 --epochs 1

Without --eval-data, every 10th shard of --data (sorted by name, at least one) is held out for
evaluation and never trained on; with too few shards for that (one, or fewer than the ranks
plus one), 10% of the samples by key hash instead. summary.json says which.

Loader threads and prefetch: --loader-threads / --prefetch, else the tuning file's choices
(shardflow tune; --tuning-file, --no-tuning), else what the loader functions
choose for the same arguments (threads: the cores divided among the ranks on this node,
torchrun's LOCAL_WORLD_SIZE). summary.json's "loader" says which was used.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from tqdm import tqdm

from shardflow.loading.shardlist import resolve_source
from shardflow.tools.util import (
    add_storage_options,
    bar_off,
    device_name,
    parse_size,
    positive_int,
    run_main,
    setup_logging,
)
from shardflow.trainers.wiring import (
    Built,
    EvalSplit,
    TaskOptions,
    build_task,
    describe_settings,
    device_of,
    split_eval,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("image", "text", "pointcloud", "pointcloud-seg", "ctr"),
                   required=True, help="pointcloud: a class per cloud; pointcloud-seg: a class "
                   "per point of LiDAR scans (trainers/segment_task.py)")
    p.add_argument("--data", required=True, help="training shards (folder with manifest.json)")
    p.add_argument("--eval-data", default=None, help="held-out shards (default: a slice of --data)")
    p.add_argument("--out", type=Path, required=True, help="the run folder")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=positive_int)
    length.add_argument("--epochs", type=positive_int)
    p.add_argument("--model", default=None,
                   help="image: small-resnet (default) or a torchvision name; text: set by "
                   "--objective; pointcloud: pointnet (default) or voxnet; pointcloud-seg: "
                   "pointnet (default) or bev (a bird's-eye-view U-Net on voxels); ctr: dlrm "
                   "(default) or deepfm")
    p.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto")
    p.add_argument("--device", type=device_name, default="auto",
                   help="where batches land and the model trains: auto, cpu, cuda or cuda:N")
    p.add_argument("--decode", choices=("auto", "cpu", "gpu"), default="auto",
                   help="where decoding and augmentation run (cpu with --device cuda: CPU "
                   "workers feed the GPU through pinned memory)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--size", type=positive_int, default=224, help="image side after cropping")
    add_augment_flags(p)
    p.add_argument("--objective", choices=("mlm", "clm"), default="clm",
                   help="text: masked (BERT-style encoder) or causal (GPT-style decoder)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="text: tokens per row")
    p.add_argument("--tokenizer", default="bytes",
                   help="text: 'bytes' (built in) or a tokenizer.json (HF tokenizers)")
    add_data_fallbacks(p)
    add_pointcloud_flags(p)
    add_ctr_flags(p)
    add_optimizer_flags(p)
    p.add_argument("--checkpoint-every", type=positive_int, default=100)
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--keep", type=positive_int, default=3)
    p.add_argument("--log-every", type=positive_int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--on-error", choices=("raise", "skip"), default="raise")
    add_loader_flags(p)
    p.add_argument("--offload-optimizer", action="store_true",
                   help="keep master weights and optimizer state in host memory")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute activations in backward instead of storing them")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--grad-compression", type=_compression, default="none",
                   metavar="{none,fp16,bf16,int8,powersgd[:RANK]}",
                   help="compress DDP gradients (trainers/compression.py; bytes in summary)")
    p.add_argument("--log-keys", action="store_true", help="write each step's keys to keys.jsonl")
    p.add_argument("--quiet", action="store_true")
    add_storage_options(p, "URLs of --data and --eval-data")
    return p


def add_optimizer_flags(p: argparse.ArgumentParser) -> None:
    """The optimizer and its learning-rate schedule (warm-up, then cosine decay)."""
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="default adamw")
    p.add_argument("--weight-decay", type=float, default=0.05, help="default 0.05")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum (default 0.9)")
    p.add_argument("--warmup", type=int, default=None, metavar="STEPS",
                   help="steps of linear learning-rate warm-up (default: 20, or a tenth of "
                   "a shorter run's steps, so that a short run is not all warm-up)")
    p.add_argument("--grad-accum", type=positive_int, default=1,
                   help="batches per optimizer step (default 1)")
    p.add_argument("--clip", type=float, default=1.0,
                   help="gradient norm limit (default 1.0); 0: no clipping")


def add_augment_flags(p: argparse.ArgumentParser) -> None:
    """The image task's training augmentation (shardflow.ops, run on the device)."""
    p.add_argument("--augment", default=None, metavar="RECIPE",
                   help="image: training batches through shardflow.ops, by timm's recipe "
                   "names: rand-m9-n2-mstd0.5 (RandAugment), trivial (TrivialAugmentWide)")
    p.add_argument("--mixup", type=float, default=0.0, metavar="ALPHA",
                   help="image: mixup's alpha (0.8 in timm's recipes); soft targets")
    p.add_argument("--cutmix", type=float, default=0.0, metavar="ALPHA",
                   help="image: cutmix's alpha (1.0 in timm's); with --mixup, half the batches")
    p.add_argument("--label-smoothing", type=float, default=0.0, metavar="E")


def add_loader_flags(p: argparse.ArgumentParser) -> None:
    """How the loaders read and decode: reader, backend, threads, prefetch, the tuning file."""
    p.add_argument("--reader", choices=("auto", "dali", "stream", "index"), default="auto",
                   help="DALI's reader (local indexed shards), the streaming one, or the "
                   "index reader (local indexed shards, no DALI; auto for stored token ids)")
    p.add_argument("--backend", choices=("auto", "dali", "portable"), default="auto",
                   help="what decodes: DALI, or the portable backend (PIL/numpy + torch, no "
                   "DALI needed); auto: DALI where it imports")
    p.add_argument("--loader-threads", type=positive_int, default=None, metavar="N",
                   help="image, pointcloud(-seg): decode threads per loader (DALI's, or the "
                   "portable pool); default: the tuning file's, else this machine's cores "
                   "divided by the ranks on this node (torchrun's LOCAL_WORLD_SIZE)")
    p.add_argument("--prefetch", type=positive_int, default=None, metavar="N",
                   help="batches each loader stage prepares ahead; default: the tuning "
                   "file's, else 2 (4 for --augment/--mixup/--cutmix on the CPU)")
    p.add_argument("--shards-in-flight", type=positive_int, default=2, metavar="N",
                   help="streaming reader: shards fetched at once per rank, their samples "
                   "interleaved (default 2)")
    p.add_argument("--index", default=None, metavar="DIR",
                   help="--data's manifest.json and .idx files lie in DIR, not beside its "
                   "shards (`shardflow index` SRC --out DIR: read-only or remote shards)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="streaming reader: keep remote shards in this local folder (shared by "
                   "the ranks of a machine), so later epochs read them from disk")
    p.add_argument("--cache-limit", type=parse_size, default=parse_size("32GiB"),
                   metavar="SIZE", help="the cache's bound (least recently used shards go "
                   "first; default 32GiB)")
    tuning = p.add_mutually_exclusive_group()
    tuning.add_argument("--tuning-file", type=Path, default=None, metavar="PATH",
                        help="the loader tuning file to use (written by `shardflow tune`; "
                        "default: ~/.cache/shardflow/tuning.json where it exists): "
                        "its choices fill in what the flags leave automatic")
    tuning.add_argument("--no-tuning", dest="use_tuning", action="store_false",
                        help="use no tuning file")


def add_pointcloud_flags(p: argparse.ArgumentParser) -> None:
    """The point-cloud tasks' points and grid: a class per cloud (pointcloud), or per point
    of LiDAR scans (pointcloud-seg, trainers/segment_task.py)."""
    p.add_argument("--num-points", type=positive_int, default=1024,
                   help="pointcloud: points per cloud (sampled or padded)")
    p.add_argument("--grid", type=positive_int, default=24,
                   help="pointcloud: voxel grid resolution (voxnet)")
    p.add_argument("--frame-points", type=_frame_points, default=None, metavar="N|all",
                   help="pointcloud-seg: points sampled from each training frame; default "
                   "20000 for pointnet, all for bev (evaluation reads every point)")
    p.add_argument("--voxel-size", type=_voxel_size, default=None, metavar="M|X,Y,Z",
                   help="pointcloud-seg, bev only: voxel edge in metres, or one per axis "
                   "(default 0.4)")
    p.add_argument("--point-range", type=float, nargs=6, default=None,
                   metavar=("XMIN", "YMIN", "ZMIN", "XMAX", "YMAX", "ZMAX"),
                   help="pointcloud-seg: the voxel grid's box in metres (default -40 -40 -3 40 "
                   "40 3, about SemanticKITTI's sensor); bev predicts nothing for a point "
                   "outside it, which counts as wrong")


def _frame_points(text: str) -> int:
    """A positive count, or "all" (0: every point)."""
    return 0 if text == "all" else positive_int(text)


def _voxel_size(text: str) -> tuple[float, float, float]:
    try:
        sizes = [float(v) for v in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 3) or not all(0 < v < float("inf") for v in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: metres > 0, one (0.4) or one per axis "
                                         "(0.2,0.2,0.4)")
    x, y, z = sizes * 3 if len(sizes) == 1 else sizes
    return x, y, z


def add_ctr_flags(p: argparse.ArgumentParser) -> None:
    """The click-through-rate task's model: table sizes, width, where the tables live."""
    p.add_argument("--embedding-dim", type=positive_int, default=16,
                   help="ctr: the width of each categorical field's embeddings")
    p.add_argument("--num-buckets", type=positive_int, default=None, metavar="N",
                   help="ctr: ids each categorical field is hashed into (a table of N rows "
                   "per field); default: the tabular loader's (2**18)")
    p.add_argument("--embeddings-on-cpu", action="store_true",
                   help="ctr: keep the embedding tables in host memory, the network on "
                   "--device (tables too large for the device; not under torchrun)")


def add_data_fallbacks(p: argparse.ArgumentParser) -> None:
    """What to use where the data says nothing: no class map, no pad token."""
    p.add_argument("--num-classes", type=positive_int, default=None,
                   help="image, pointcloud: classes when the manifest has no class map or "
                   "label statistics (labels 0..N-1); pointcloud-seg: when its manifest gives "
                   "no class count (the ignored label counted)")
    p.add_argument("--pad-token", default=None,
                   help="text: the token that pads rows, for a tokenizer.json without a pad "
                   "token (default there: its end-of-text / separator token)")


def run(trainer: Any, evaluation: Any, held_out: str, steps: int, quiet: bool
        ) -> dict[str, Any]:
    from shardflow.trainers.run import fit

    with tqdm(total=steps, disable=bar_off(quiet), unit="step") as bar:
        def progress(r: dict[str, Any]) -> None:
            bar.update(r["step"] - bar.n)
            bar.set_postfix_str(f"loss {r['loss']:.3f} {r['samples_per_s']:.0f}/s "
                                f"wait {r['data_wait']:.0%}")
        return fit(trainer, eval_loader=evaluation if evaluation is not None else [],
                   held_out=held_out, progress=progress)


def main(argv: list[str] | None = None) -> int:
    import torch

    from shardflow.trainers import distributed

    args = build_parser().parse_args(argv)
    info = distributed.from_torchrun_env()  # torchrun's RANK/WORLD_SIZE/LOCAL_RANK
    setup_logging(args.quiet or not info.is_main)
    trainer_level = logging.INFO if info.is_main else logging.WARNING
    logging.getLogger("shardflow.trainers").setLevel(trainer_level)
    if info.is_main and not args.quiet:  # which tuned choices the loaders use, and why not
        logging.getLogger("shardflow.loading.tuning").setLevel(logging.INFO)
    distributed.init(info, use_cuda=args.device != "cpu" and torch.cuda.is_available())
    split = split_eval(resolve_source(args.data, storage_options=args.storage_options,
                                      index=args.index),
                       args.eval_data, info.world_size, args.storage_options)
    torch.manual_seed(args.seed)
    # The same seed on every rank: every rank starts from the same weights.
    opts = TaskOptions(**{f.name: getattr(args, f.name) for f in fields(TaskOptions)})
    built = build_task(opts, split, info.rank, info.world_size, local_world_size())
    try:
        trainer, steps = make_trainer(args, built, split, info)
        summary = run(trainer, built.evaluation, split.how, steps,
                      args.quiet or not info.is_main)
    finally:
        built.loader.close()
        if built.evaluation is not None:
            built.evaluation.close()
        distributed.finish(info)
    if not info.is_main:
        return 0
    if not summary.get("wall_s"):
        print(f"{args.out}: this run already finished; see its summary.json")
        return 0
    add_to_summary(args.out, {"loader": built.loader_settings})
    resumed = summary.get("resumed_at_step")
    ran = f"{summary['steps_this_run']} steps" + (
        f" (resumed at step {resumed}, to step {summary['steps']})" if resumed else "")
    print(f"{ran} in {summary['wall_s']:.1f} s ({summary['device']}, "
          f"{summary['precision']}): loss {summary['final_loss']:.3f}, "
          f"{evaluation_line(summary)}, {summary['samples_per_s']:.0f} "
          f"samples/s; run folder {args.out}")
    print(f"loader: {describe_settings(built.loader_settings)}; evaluation: {split.how}")
    print(summary["bottleneck"]["advice"])
    return 0


def evaluation_line(summary: dict[str, Any]) -> str:
    """The held-out figures in a few words: AUC and logloss for ctr, mIoU and point accuracy
    for pointcloud-seg, else loss and accuracy."""
    nan = float("nan")
    if "auc" in summary:
        return f"eval AUC {summary['auc']:.4f}, eval logloss {summary.get('logloss', nan):.4f}"
    if "miou" in summary:
        return (f"eval mIoU {summary['miou']:.3f}, eval point accuracy "
                f"{summary.get('accuracy', nan):.3f}")
    return (f"eval loss {summary.get('eval_loss', nan):.3f}, eval accuracy "
            f"{summary.get('accuracy', nan):.3f}")


def make_trainer(args: argparse.Namespace, built: Built, split: EvalSplit, info: Any
                 ) -> tuple[Any, int]:
    """The Trainer of the run (its model wrapped for DDP, then compiled, as asked), and the
    steps to train."""
    from shardflow.trainers import distributed
    from shardflow.trainers.loop import TrainConfig, Trainer

    device, task = device_of(built.loader), built.task
    if args.epochs and args.task == "text":
        raise ValueError("--epochs needs the loader's length, which for packed text depends "
                         "on the token count; pass --steps")
    # With a held-out slice by key, an epoch has the same batches, each without that slice.
    steps = args.steps or args.epochs * epoch_length(built.loader) // args.grad_accum
    if args.grad_compression != "none" and not info.active:
        raise ValueError(f"--grad-compression {args.grad_compression} compresses what DDP's "
                         "ranks exchange, and this run has one process: start it with "
                         "torchrun, or leave the flag out")
    cfg = TrainConfig(run_dir=args.out, steps=steps, lr=args.lr, optimizer=args.optimizer,
                      weight_decay=args.weight_decay, momentum=args.momentum,
                      warmup=warmup_steps(args.warmup, steps), grad_accum=args.grad_accum,
                      clip=args.clip or None,
                      precision=args.precision, log_every=args.log_every,
                      checkpoint_every=args.checkpoint_every,
                      checkpoint_minutes=args.checkpoint_minutes, keep=args.keep,
                      seed=args.seed, log_keys=args.log_keys,
                      offload_optimizer=args.offload_optimizer)
    # DDP first, then compile: DDP's bucket-wise all-reduce overlaps backward only so.
    task.model = distributed.wrap_then_compile(task.model, info, device, args.grad_compression,
                                               "inductor" if args.compile else None)
    # A checkpoint continues only the run it was made for: the same data, and the same
    # samples held out of it when they are chosen by key.
    data = {"data": split.train.fingerprint(),
            **({"held_out_by_key": f"{split.by_key}%"} if split.by_key else {})}
    return Trainer(task, built.loader, cfg, device, data, info), steps


def warmup_steps(given: int | None, steps: int) -> int:
    """--warmup as given, else 20 steps or a tenth of the run, whichever is fewer."""
    return given if given is not None else min(20, steps // 10)


def _compression(spec: str) -> str:
    from shardflow.trainers.compression import parse

    try:
        parse(spec)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return spec


def epoch_length(loader: Any) -> int:
    """Batches per epoch, for --epochs; a loader that cannot know it says why (tabular rows
    over several ranks or part of the shards: rows per rank are known only once read)."""
    try:
        return len(loader)
    except TypeError as err:
        raise ValueError(f"--epochs needs the loader's length: {err}; pass --steps (for "
                         "tabular data: or --eval-data, so that --data is read whole)") from None


def local_world_size() -> int:
    """The ranks on this node, which share its cores: torchrun's LOCAL_WORLD_SIZE, else 1."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={text!r}: expected a positive integer (torchrun "
                         "sets it)")
    return int(text)


def add_to_summary(run_dir: Path, entries: dict[str, Any]) -> None:
    """`entries` added to the summary.json that `fit` wrote (what only this tool knows)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text())
    path.write_text(json.dumps({**summary, **entries}, indent=1) + "\n")


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    run_main(lambda: main(argv))


if __name__ == "__main__":
    entry()
