"""Gradient accumulation and the ranks: accumulation equal to the larger batch; under DDP one
all-reduce per optimizer step (no_sync on the other micro-steps); DDP wrapped before
torch.compile; evaluation split over ranks with the metrics of one process evaluating it all.
The DDP checks run 2 gloo ranks (torch.multiprocessing spawn) on the CPU."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_tool
from torch import nn

from shardflow.builtin import make_image_folder
from shardflow.loading.batch import ImageBatch
from shardflow.loading.shardlist import ShardSpec, Source, resolve_source
from shardflow.trainers.classify import Classification
from shardflow.trainers.distributed import DistInfo
from shardflow.trainers.loop import TrainConfig, Trainer
from shardflow.trainers.wiring import TaskOptions, build_task, eval_share, split_eval

CPU = torch.device("cpu")


class LinearTask(Classification):
    """A linear classifier over the pixels: no batch statistics, so a batch of 2B and two
    micro-batches of B give the same gradient (BatchNorm would not)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))

    def _inputs(self, batch: Any) -> torch.Tensor:
        return batch.image.float() / 255

    def describe(self) -> dict[str, Any]:
        return {"task": "linear"}


def batches(n: int, size: int = 4, seed: int = 0) -> list[ImageBatch]:
    g = torch.Generator().manual_seed(seed)
    return [ImageBatch(torch.randint(0, 256, (size, 3, 8, 8), dtype=torch.uint8, generator=g),
                       torch.randint(0, 10, (size,), generator=g), [f"k{i}"] * size)
            for i in range(n)]


def pairs(micro: list[ImageBatch]) -> list[ImageBatch]:
    """Each two micro-batches as one batch of twice the size."""
    return [ImageBatch(torch.cat([a.image, b.image]), torch.cat([a.label, b.label]),
                       a.keys + b.keys) for a, b in zip(micro[::2], micro[1::2], strict=True)]


def train(task: LinearTask, data: list[ImageBatch], run_dir: Path, grad_accum: int,
          dist: DistInfo | None = None) -> Trainer:
    # SGD without clipping: AdamW and clipping are nearly blind to the gradient's scale, so
    # they would hide an accumulation that forgets to divide by grad_accum.
    cfg = TrainConfig(run_dir=run_dir, steps=len(data) // grad_accum, warmup=0, lr=0.1,
                      optimizer="sgd", clip=None, precision="fp32", grad_accum=grad_accum)
    trainer = Trainer(task, None, cfg, CPU, {}, dist)
    for batch in data:
        trainer.micro_step(batch)
    assert trainer.step == cfg.steps
    return trainer


def test_accumulating_two_batches_equals_one_batch_of_twice_the_size(tmp_path):
    micro = batches(6)
    accumulated, larger = LinearTask(), LinearTask()
    train(accumulated, micro, tmp_path / "a", grad_accum=2)
    train(larger, pairs(micro), tmp_path / "b", grad_accum=1)
    for a, b in zip(accumulated.model.parameters(), larger.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert not torch.equal(accumulated.model[1].weight, LinearTask().model[1].weight)


def test_eval_shares_are_disjoint_cover_every_shard_and_leave_a_rank_without_none_twice():
    held = Source(tuple(ShardSpec(f"s/{i}.tar", n) for i, n in enumerate([30, 10, 10, 10, 25])))
    for world in (1, 2, 3, 5, 7):
        shares = [eval_share(held, rank, world) for rank in range(world)]
        urls = [s.url for share in shares if share is not None for s in share.shards]
        assert sorted(urls) == sorted(s.url for s in held.shards) and len(set(urls)) == 5
        assert sum(share is None for share in shares) == max(0, world - 5)
    two = [eval_share(held, rank, 2) for rank in range(2)]
    assert [share.total for share in two if share is not None] == [40, 45]  # balanced


# -- two gloo ranks ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, out: str, data: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        info, results = DistInfo(rank, 2), {}
        results["no_sync"] = _accumulate_under_ddp(info, Path(out) / f"r{rank}")
        results["compiled"] = _compile_after_ddp(info, Path(out) / f"c{rank}")
        results["eval"] = _evaluate_on_two_ranks(info, Path(data), Path(out) / f"e{rank}")
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _counted_ddp(info: DistInfo, calls: list[int], compile_backend: str | None = None
                 ) -> tuple[LinearTask, Any]:
    """A LinearTask whose model is in DDP (then compiled, if asked), each all-reduce of a
    gradient bucket counted by a communication hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from shardflow.trainers.distributed import wrap, wrap_then_compile

    def counting(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        calls.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    task = LinearTask()
    ddp = wrap(task.model, info, CPU, "none")
    ddp.register_comm_hook(None, counting)
    task.model = ddp if compile_backend is None else \
        wrap_then_compile(ddp, DistInfo(), CPU, "none", compile_backend)  # DDP already on
    return task, ddp


def _accumulate_under_ddp(info: DistInfo, run: Path) -> dict[str, Any]:
    calls: list[int] = []
    task, _ = _counted_ddp(info, calls)
    micro = batches(6, seed=info.rank)  # each rank its own data
    train(task, micro, run / "accum", grad_accum=2, dist=info)
    reference, _ = _counted_ddp(info, [])
    train(reference, pairs(micro), run / "larger", grad_accum=1, dist=info)
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in
               zip(task.model.parameters(), reference.model.parameters(), strict=True))
    return {"allreduces": len(calls), "same_as_larger_batch": same,
            "weights": task.model.module[1].weight.sum().item()}


def _compile_after_ddp(info: DistInfo, run: Path) -> dict[str, Any]:
    """The tool's order, through its helper: the compiled module wraps the DDP module."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.parallel import DistributedDataParallel

    from shardflow.trainers.distributed import distributed_module, unwrap, wrap_then_compile

    task = LinearTask()
    bare = task.model
    model = wrap_then_compile(bare, info, CPU, "none", "aot_eager")
    order = isinstance(model, OptimizedModule) and \
        isinstance(model._orig_mod, DistributedDataParallel) and model._orig_mod.module is bare
    found = unwrap(model) is bare and distributed_module(model) is model._orig_mod
    calls: list[int] = []
    counted, _ = _counted_ddp(info, calls, compile_backend="aot_eager")
    trainer = train(counted, batches(4, seed=info.rank), run, grad_accum=2, dist=info)
    keys = set(unwrap(counted.model).state_dict())  # what Trainer.state_dict saves
    return {"order": order, "unwrap": found, "allreduces": len(calls),
            "state_keys": sorted(keys), "setup": trainer.setup()}


def _evaluate_on_two_ranks(info: DistInfo, data: Path, run: Path) -> dict[str, Any]:
    """Each case: this rank's share evaluated, combined over ranks; and, on every rank, one
    process evaluating all of the same held-out data, for comparison."""
    source, results = resolve_source(data), {}
    opts = TaskOptions(task="image", data=str(data), batch_size=8, size=16, device="cpu",
                       backend="portable", loader_threads=1, use_tuning=False)
    cases = {"--eval-data": split_eval(source, str(data), 2),
             "one held-out shard": split_eval(source, None, 2)}
    for name, split in cases.items():
        results[name] = {}
        for world, rank in ((2, info.rank), (1, 0)):
            torch.manual_seed(0)  # the same weights on every rank and in both evaluations
            built = build_task(opts, split, rank, world)
            dist = info if world == 2 else DistInfo()
            trainer = Trainer(built.task, built.loader, TrainConfig(run_dir=run, steps=1,
                                                                    precision="fp32"),
                              CPU, {}, dist)
            try:
                keys = [] if built.evaluation is None else \
                    [k for batch in built.evaluation for k in batch.keys]
                metrics = trainer.evaluate(built.evaluation or [])
            finally:
                built.loader.close()
                if built.evaluation is not None:
                    built.evaluation.close()
            results[name][f"world{world}"] = {"metrics": metrics, "keys": keys}
    return results


@pytest.fixture(scope="module")
def four_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("four")
    src = make_image_folder(root / "src", per_class=12, size=24)
    run_tool("make_shards", "imagefolder", src, root / "shards", "--max-count", 30,
             "--shuffle-seed", 0, check=True)
    return root / "shards"


@pytest.mark.slow
def test_two_gloo_ranks_accumulate_compile_and_evaluate_as_one_process(four_shards, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path), str(four_shards)), nprocs=2,
             join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        # grad_accum=2 over 3 optimizer steps: 3 all-reduces of the one bucket, not 6
        assert r["no_sync"]["allreduces"] == 3 and r["no_sync"]["same_as_larger_batch"]
        compiled = r["compiled"]
        assert compiled["order"] and compiled["unwrap"] and compiled["allreduces"] == 2
        assert compiled["state_keys"] == ["1.bias", "1.weight"]  # the bare model's
        assert compiled["setup"]["compiled"] and compiled["setup"]["ddp"]
    assert ranks[0]["no_sync"]["weights"] == ranks[1]["no_sync"]["weights"]
    for case in ("--eval-data", "one held-out shard"):
        shares = [r["eval"][case]["world2"] for r in ranks]
        whole = ranks[0]["eval"][case]["world1"]
        mine = [set(share["keys"]) for share in shares]
        assert not mine[0] & mine[1] and mine[0] | mine[1] == set(whole["keys"])
        assert len(whole["keys"]) == len(set(whole["keys"])) > 0
        for share in shares:  # every rank returns the metrics of all of it
            assert share["metrics"]["accuracy"] == whole["metrics"]["accuracy"]
            assert share["metrics"]["eval_loss"] == pytest.approx(whole["metrics"]["eval_loss"],
                                                                  rel=1e-6)
    assert all(s["keys"] for s in (r["eval"]["--eval-data"]["world2"] for r in ranks))
    assert not ranks[1]["eval"]["one held-out shard"]["world2"]["keys"]  # waited, added none
