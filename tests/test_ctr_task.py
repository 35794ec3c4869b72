"""The click-through-rate side: the synthetic click logs (pipeline/builtin/ctr.py), the metrics
(AUC, logloss), DLRM and DeepFM, the task under the Trainer, and the tables kept on the CPU.

Batches here are built in the test from the generator's rows, hashed as the tabular loader
hashes (id 0 for a missing value); the end-to-end tests at the bottom go through the real
converter, loader and tools/train.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, run_tool

from shardflow.builtin.ctr import (
    CATEGORICAL,
    DENSE,
    PLANTED,
    Rows,
    Signal,
    draw_rows,
    format_rows,
    make_ctr_dataset,
)
from shardflow.builtin.ctr import roc_auc as data_side_auc
from shardflow.loading.batch import TabularBatch
from shardflow.trainers.ctr_metrics import ScoredTotals, logloss_of_logits, roc_auc
from shardflow.trainers.ctr_models import DLRM, DeepFM, FieldEmbeddings, build_ctr_model
from shardflow.trainers.ctr_task import ClickThroughRate
from shardflow.trainers.distributed import DistInfo
from shardflow.trainers.loop import TrainConfig, Trainer

CPU = torch.device("cpu")
FIELDS = len(CATEGORICAL)


def _batch(rows: Rows, index: np.ndarray, buckets: int) -> TabularBatch:
    """Rows as the loader gives them: log1p counts (missing: 0), ids hashed into
    [1, buckets) with 0 for missing."""
    counts, ids = rows.counts[index], rows.ids[index]
    dense = np.log1p(np.maximum(counts, 0)).astype(np.float32)
    mixed = (ids * 2654435761 + 12345) % (buckets - 1) + 1
    sparse = np.where(ids >= 0, mixed, 0)
    return TabularBatch(torch.from_numpy(dense), torch.from_numpy(sparse),
                        torch.from_numpy(rows.label[index].astype(np.float32)),
                        [f"b:{i}" for i in index])


def _random_batch(n: int = 32, dense: int = 13, buckets: int = 50, seed: int = 0
                  ) -> TabularBatch:
    g = torch.Generator().manual_seed(seed)
    return TabularBatch(torch.rand(n, dense, generator=g) * 5,
                        torch.randint(0, buckets, (n, FIELDS), generator=g),
                        torch.randint(0, 2, (n,), generator=g).float(), [str(i) for i in range(n)])


# -- the synthetic click logs -------------------------------------------------------------------


def test_click_logs_are_criteo_lines_and_the_same_bytes_for_the_same_arguments(tmp_path):
    a = make_ctr_dataset(tmp_path / "a", rows=3000, files=2, seed=3)
    b = make_ctr_dataset(tmp_path / "b", rows=3000, files=2, seed=3)
    c = make_ctr_dataset(tmp_path / "c", rows=3000, files=2, seed=4)
    names = sorted(p.name for p in a.iterdir())
    assert names == ["part-00000.tsv", "part-00001.tsv", PLANTED]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / names[0]).read_bytes() != (c / names[0]).read_bytes()
    lines = [line.split("\t") for p in sorted(a.glob("*.tsv"))
             for line in p.read_text().splitlines()]
    assert len(lines) == 3000 and {len(fields) for fields in lines} == {40}
    assert {f[0] for f in lines} == {"0", "1"}
    counts = [f[1:14] for f in lines]
    assert all(v == "" or v.isdigit() or (i == 1 and v in ("-1", "-2", "-3"))
               for row in counts for i, v in enumerate(row))
    assert 20 < sum(row[1].startswith("-") for row in counts) < 110  # I2: 2%, as Criteo's
    ids = [f[14:] for f in lines]
    assert all(v == "" or (len(v) == 8 and int(v, 16) >= 0) for row in ids for v in row)
    # Missing shares as planned: I12 (77%) and C22 (76%) mostly empty, I2 and C1 never.
    column = list(zip(*lines, strict=True))
    assert 0.7 < column[12].count("") / 3000 < 0.84 and column[2].count("") == 0
    assert 0.7 < column[14 + 21].count("") / 3000 < 0.82 and column[14].count("") == 0
    # The hex ids are one string per value: C9 has 3 values, C6 20.
    assert len(set(column[14 + 8])) == 3 and len(set(column[14 + 5])) == 20


def test_planted_figures_are_recorded_and_are_what_the_truth_scores(tmp_path):
    out = make_ctr_dataset(tmp_path / "d", rows=4000)
    planted = json.loads((out / PLANTED).read_text())
    assert 0.78 < planted["achievable_auc"] < 0.9
    assert planted["achievable_logloss"] < planted["prior_logloss"] < 0.6
    assert 0.2 < planted["click_rate"] < 0.3
    assert abs(planted["achievable_auc_on_written_rows"] - planted["achievable_auc"]) < 0.04
    labels = np.array([int(line.split("\t", 1)[0]) for line in
                       (out / "part-00000.tsv").read_text().splitlines()])
    assert abs(labels.mean() - planted["click_rate"]) < 1e-3
    assert planted["signal"]["interaction"] == ["C17", "C23"]


def test_a_generator_refuses_a_folder_with_files_and_impossible_sizes(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("old")
    with pytest.raises(ValueError, match="not empty"):
        make_ctr_dataset(tmp_path / "full", rows=10)
    with pytest.raises(ValueError, match="files=3"):
        make_ctr_dataset(tmp_path / "new", rows=2, files=3)


# -- metrics ------------------------------------------------------------------------------------


def _pairwise_auc(label: np.ndarray, score: np.ndarray) -> float:
    pos, neg = score[label == 1], score[label == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


@pytest.mark.parametrize("seed", range(4))
def test_auc_is_the_pairwise_win_rate_with_ties_counted_half(seed):
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 2, 300)
    score = rng.integers(0, 12, 300).astype(np.float32) + label * rng.random(300)  # many ties
    assert roc_auc(label, score) == pytest.approx(_pairwise_auc(label, score), abs=1e-12)
    assert data_side_auc(label, score) == pytest.approx(roc_auc(label, score), abs=1e-12)


def test_auc_edges():
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert roc_auc(np.array([1, 1, 0, 0]), np.array([0.1, 0.2, 0.3, 0.4])) == 0.0
    assert roc_auc(np.array([1, 0, 1, 0]), np.full(4, 0.7)) == 0.5
    assert math.isnan(roc_auc(np.ones(5), np.arange(5.0)))
    assert math.isnan(roc_auc(np.array([]), np.array([])))


def test_logloss_of_logits_is_the_cross_entropy_and_finite_at_extreme_logits():
    label = np.array([1, 0, 1, 0])
    logit = np.array([2.0, -1.0, -0.5, 0.3])
    p = 1 / (1 + np.exp(-logit))
    expected = -np.mean(label * np.log(p) + (1 - label) * np.log(1 - p))
    assert logloss_of_logits(label, logit) == pytest.approx(expected, rel=1e-12)
    assert logloss_of_logits(np.array([1, 0]), np.array([1e4, -1e4])) == pytest.approx(0.0)
    assert logloss_of_logits(np.array([0]), np.array([1e4])) == pytest.approx(1e4)


def test_scored_totals_add_batches_and_give_auc_and_logloss():
    totals = ScoredTotals()
    rng = np.random.default_rng(0)
    label, logit = rng.integers(0, 2, 100).astype(np.uint8), rng.normal(size=100)
    for part in range(4):
        cut = slice(25 * part, 25 * (part + 1))
        totals.add(ScoredTotals(0.0, 0, 25, [logit[cut].astype(np.float32)], [label[cut]]))
    metrics = totals.over_ranks(DistInfo())
    assert set(metrics) == {"eval_loss", "logloss", "auc", "scored_rows"}
    assert metrics["scored_rows"] == 100
    assert metrics["auc"] == pytest.approx(roc_auc(label, logit.astype(np.float32)))
    assert metrics["logloss"] == metrics["eval_loss"] == pytest.approx(
        logloss_of_logits(label, logit), rel=1e-6)
    assert totals.count == 100
    empty = ScoredTotals().over_ranks(DistInfo())
    assert math.isnan(empty["auc"]) and empty["scored_rows"] == 0


# -- models -------------------------------------------------------------------------------------


def test_field_embeddings_give_each_field_its_own_rows():
    torch.manual_seed(0)
    table = FieldEmbeddings([3, 5, 2], dim=4)
    ids = torch.tensor([[0, 0, 0], [2, 4, 1]])
    out = table(ids, CPU)
    weight = table.bag.weight
    assert out.shape == (2, 3, 4)
    assert torch.equal(out[1, 0], weight[2]) and torch.equal(out[1, 1], weight[3 + 4])
    assert torch.equal(out[1, 2], weight[3 + 5 + 1]) and torch.equal(out[0, 1], weight[3])
    with pytest.raises(ValueError, match=r"expected \(batch, 3\)"):
        table(torch.zeros(2, 4, dtype=torch.int64), CPU)
    with pytest.raises(ValueError, match="one positive size"):
        FieldEmbeddings([3, 0], dim=4)


def test_deepfm_second_order_term_is_the_sum_of_every_pair_of_embeddings():
    torch.manual_seed(0)
    model = DeepFM(num_dense=2, num_buckets=[7] * 4, dim=3)
    dense, sparse = torch.rand(5, 2), torch.randint(0, 7, (5, 4))
    vectors = model.embeddings(sparse, CPU)
    pairs = sum((vectors[:, i] * vectors[:, j]).sum(1) for i in range(4) for j in range(i + 1, 4))
    first = model.weights(sparse, CPU).sum((1, 2)) + model.linear(dense).squeeze(1)
    deep = model.deep(torch.cat([vectors.flatten(1), dense], 1)).squeeze(1)
    assert torch.allclose(model(dense, sparse), first + pairs + deep, atol=1e-6)


def test_dlrm_interacts_every_pair_once_and_runs_without_dense_features():
    torch.manual_seed(0)
    model = DLRM(num_dense=13, num_buckets=[50] * FIELDS, dim=8)
    assert model.pairs.shape == (2, 27 * 26 // 2)
    assert model.top[0].in_features == 27 * 26 // 2 + 8
    batch = _random_batch()
    assert model(batch.dense, batch.sparse).shape == (32,)
    avazu = DLRM(num_dense=0, num_buckets=[50] * 22, dim=8)  # every column categorical
    assert avazu.bottom is None and avazu.top[0].in_features == 22 * 21 // 2
    out = avazu(torch.zeros(4, 0), torch.randint(0, 50, (4, 22)))
    assert out.shape == (4,) and torch.isfinite(out).all()
    no_dense = build_ctr_model("deepfm", 0, [50] * 22, dim=4)
    assert no_dense(torch.zeros(4, 0), torch.randint(0, 50, (4, 22))).shape == (4,)
    with pytest.raises(ValueError, match="--model wide: choose one of dlrm, deepfm"):
        build_ctr_model("wide", 13, [50] * FIELDS)


def _two_steps(task: ClickThroughRate, tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    cfg = TrainConfig(run_dir=tmp_path / name, steps=2, warmup=0, precision="fp32")
    trainer = Trainer(task, loader=None, cfg=cfg, device=CPU, fingerprint={})
    for seed in range(2):
        trainer.micro_step(_random_batch(seed=seed))
    return {k: v.detach().clone() for k, v in task.model.state_dict().items()}


@pytest.mark.parametrize("model", ["dlrm", "deepfm"])
def test_tables_kept_on_the_cpu_train_as_the_model_all_on_one_device(tmp_path, model):
    """On a CPU-only machine both placements are the CPU: this checks that placing the tables
    apart changes no number (outputs, two AdamW steps). The GPU test below checks the real
    split, tables on the host and the network on the device."""
    torch.manual_seed(0)
    together = ClickThroughRate(model, 13, [50] * FIELDS, CPU, embedding_dim=8)
    apart = ClickThroughRate(model, 13, [50] * FIELDS, CPU, embedding_dim=8)
    apart.model.load_state_dict(together.model.state_dict())
    apart.model.place(CPU, embeddings_on_cpu=True)
    batch = _random_batch(seed=5)
    assert torch.equal(together.model(batch.dense, batch.sparse),
                       apart.model(batch.dense, batch.sparse))
    a, b = _two_steps(together, tmp_path, "together"), _two_steps(apart, tmp_path, "apart")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model", ["dlrm", "deepfm"])
def test_placing_tables_on_the_host_moves_the_rest_and_only_the_rest(model):
    """The "meta" device stands in for an accelerator: tensors there have shapes and no
    values, which is enough to check where everything lives and that a forward pass crosses
    from the host tables to the network's device."""
    net = build_ctr_model(model, 13, [50] * FIELDS, dim=8).place("meta", embeddings_on_cpu=True)
    tables = [m for m in net.modules() if isinstance(m, FieldEmbeddings)]
    assert tables and all(p.device.type == "cpu" for t in tables for p in t.parameters())
    assert all(b.device.type == "cpu" for t in tables for b in t.buffers())
    rest = [p for n, p in net.named_parameters() if not n.startswith(("embeddings.", "weights."))]
    assert rest and all(p.device.type == "meta" for p in rest)
    assert all(b.device.type == "meta" for b in net._buffers.values() if b is not None)
    out = net(torch.rand(4, 13, device="meta"), torch.randint(0, 50, (4, FIELDS)))
    assert out.device.type == "meta" and out.shape == (4,)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["dlrm", "deepfm"])
def test_tables_on_the_host_and_the_network_on_the_gpu_match_all_on_the_gpu(tmp_path, model):
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    together = ClickThroughRate(model, 13, [50] * FIELDS, cuda, embedding_dim=8)
    apart = ClickThroughRate(model, 13, [50] * FIELDS, cuda, embedding_dim=8,
                             embeddings_on_cpu=True)
    apart.model.load_state_dict(together.model.state_dict())
    assert all(p.device.type == "cpu" for p in apart.model.embeddings.parameters())
    assert all(p.device.type == "cuda" for n, p in apart.model.named_parameters()
               if not n.startswith(("embeddings.", "weights.")))
    results = []
    for task in (together, apart):
        cfg = TrainConfig(run_dir=tmp_path / str(len(results)), steps=3, warmup=0,
                          precision="fp32")
        trainer = Trainer(task, loader=None, cfg=cfg, device=cuda, fingerprint={})
        for seed in range(3):
            b = _random_batch(seed=seed)
            trainer.micro_step(TabularBatch(b.dense.to(cuda), b.sparse.to(cuda),
                                            b.label.to(cuda), b.keys))
        results.append({k: v.detach().cpu() for k, v in task.model.state_dict().items()})
    for name, value in results[0].items():
        assert torch.allclose(value, results[1][name], atol=1e-5), name


def _pooled_through(monkeypatch: pytest.MonkeyPatch, out_device: torch.device
                    ) -> tuple[list[tuple[int, ...]], FieldEmbeddings]:
    """One forward and backward of host tables into `out_device`; the shapes pinned."""
    emb = FieldEmbeddings([50] * FIELDS, 4)
    pinned: list[tuple[int, ...]] = []
    real = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: (
        pinned.append(tuple(self.shape)), real(self, *a, **k))[1])
    out = emb(torch.randint(0, 50, (8, FIELDS)), out_device)
    assert out.device.type == out_device.type and out.shape == (8, FIELDS, 4)
    out.square().sum().backward()
    assert emb.bag.weight.grad is not None and emb.bag.weight.grad.abs().sum() > 0
    return pinned, emb


def test_pooled_vectors_are_not_pinned_when_they_stay_on_the_host(monkeypatch):
    pinned, _ = _pooled_through(monkeypatch, CPU)
    assert pinned == []


@pytest.mark.gpu
def test_pooled_vectors_cross_to_the_gpu_from_pinned_memory(monkeypatch):
    """Host tables, the network on the GPU: the pooled vectors are pinned before their
    non_blocking copy (from pageable memory nothing overlaps), and the gradients still reach
    the tables through pin_memory."""
    pinned, _ = _pooled_through(monkeypatch, torch.device("cuda"))
    assert pinned == [(8, FIELDS, 4)]


def test_pooled_vectors_bound_for_cuda_are_pinned_then_copied_without_blocking(monkeypatch):
    """The CPU twin of the test above, CUDA faked where the pooled vectors meet it:
    pin_memory (which needs an accelerator) hands the tensor back, noted; the copy to "cuda"
    is noted, not made. The pinned tensor is what crosses, without blocking, and the
    gradients still reach the tables."""
    emb = FieldEmbeddings([50] * FIELDS, 4)
    pinned: list[torch.Tensor] = []
    crossed: list[tuple[bool, bool]] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self, *a, **k: (pinned.append(self), self)[1])
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, str | torch.device) and torch.device(target).type == "cuda":
            crossed.append((any(self is p for p in pinned), kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    out = emb(torch.randint(0, 50, (8, FIELDS)), torch.device("cuda"))
    assert [tuple(p.shape) for p in pinned] == [(8, FIELDS, 4)] and crossed == [(True, True)]
    out.square().sum().backward()
    assert emb.bag.weight.grad is not None and emb.bag.weight.grad.abs().sum() > 0


# -- the task -----------------------------------------------------------------------------------


def test_task_loss_is_binary_cross_entropy_and_evaluation_ranks_every_row(tmp_path):
    torch.manual_seed(0)
    task = ClickThroughRate("dlrm", 13, [50] * FIELDS, CPU, embedding_dim=8)
    batches = [_random_batch(seed=s) for s in range(3)]
    logits = torch.cat([task.model(b.dense, b.sparse).detach() for b in batches])
    labels = torch.cat([b.label for b in batches])
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits[:32], labels[:32])
    assert torch.allclose(task.forward(batches[0]).loss, expected)
    cfg = TrainConfig(run_dir=tmp_path, steps=1, precision="fp32")
    metrics = Trainer(task, loader=None, cfg=cfg, device=CPU, fingerprint={}).evaluate(batches)
    assert metrics["auc"] == pytest.approx(roc_auc(labels.numpy(), logits.numpy()))
    assert metrics["logloss"] == pytest.approx(
        logloss_of_logits(labels.numpy(), logits.numpy()), rel=1e-5)
    assert task.describe() == {"task": "ctr", "model": "dlrm", "num_dense": 13,
                               "num_buckets": [50] * FIELDS, "embedding_dim": 8}


def test_a_batch_of_another_schema_is_refused_with_both_shapes():
    task = ClickThroughRate("deepfm", 13, [50] * FIELDS, CPU, embedding_dim=4)
    batch = _random_batch(dense=12)
    with pytest.raises(ValueError, match="12 dense and 26 categorical fields for a model "
                                         "built for 13 and 26"):
        task.forward(batch)


def _learn(model: str, steps: int, lr: float, tmp_path: Path) -> tuple[float, float, float]:
    """Train on fresh rows of the planted process, under a single pass (as CTR models
    train: a second pass over the same rows overfits the ids seen once); the held-out AUC,
    the achievable one on those rows, and the held-out logloss."""
    signal, buckets = Signal.of_seed(0), 1024
    train = draw_rows(signal, np.random.default_rng([0, 10]), steps * 256)
    held = draw_rows(signal, np.random.default_rng([0, 11]), 8000)
    torch.manual_seed(0)
    task = ClickThroughRate(model, len(DENSE), [buckets] * FIELDS, CPU, embedding_dim=8)
    cfg = TrainConfig(run_dir=tmp_path / model, steps=steps, lr=lr, warmup=10,
                      precision="auto")
    trainer = Trainer(task, loader=None, cfg=cfg, device=CPU, fingerprint={})
    for step in range(steps):
        trainer.micro_step(_batch(train, np.arange(step * 256, (step + 1) * 256), buckets))
    metrics = trainer.evaluate([_batch(held, np.arange(i, i + 2000), buckets)
                                for i in range(0, 8000, 2000)])
    return metrics["auc"], roc_auc(held.label, held.truth), metrics["logloss"]


@pytest.mark.accuracy
def test_dlrm_learns_the_planted_signal_to_within_003_of_the_achievable_auc(tmp_path):
    auc, achievable, loss = _learn("dlrm", 250, 1e-2, tmp_path)
    assert achievable - 0.03 < auc <= achievable + 0.01, (auc, achievable)
    assert loss < 0.47  # predicting the click rate alone: about 0.56


@pytest.mark.accuracy
def test_deepfm_learns_the_planted_signal(tmp_path):
    """DeepFM sums every pair of fields with equal weight, the 20 noise fields' pairs too,
    where DLRM's top MLP learns to ignore them: on these logs it stays further below."""
    auc, achievable, loss = _learn("deepfm", 250, 3e-3, tmp_path)
    assert achievable - 0.08 < auc <= achievable + 0.01, (auc, achievable)
    assert loss < 0.5


# -- end to end: generator -> make_shards tabular -> tools/train.py -------------------------


@pytest.fixture(scope="module")
def click_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12,000 built-in click-log rows in 24 blocks of 500, 3 a shard: 8 shards."""
    root = tmp_path_factory.mktemp("ctr")
    raw = make_ctr_dataset(root / "raw", rows=12_000, files=2)
    run_tool("make_shards", "tabular", raw, root / "shards", "--preset", "criteo",
             "--rows-per-block", 500, "--max-count", 3, "--workers", 1, "--quiet", check=True)
    return root / "shards"


def _train(data: Path, out: Path, *args: object, check: bool = True):
    return run_tool("train", "--task", "ctr", "--data", data, "--out", out, "--batch-size", 128,
                    "--num-buckets", 512, "--embedding-dim", 4, "--quiet", *args, check=check)


def test_train_tool_reports_auc_and_logloss_in_summary_eval_log_and_curves(click_shards,
                                                                            tmp_path):
    out = tmp_path / "run"
    proc = _train(click_shards, out, "--model", "dlrm", "--steps", 12, "--log-every", 4)
    summary = json.loads((out / "summary.json").read_text())
    # the held-out shard (3 blocks of 500 rows), every row scored once; 12 steps learn
    # something: a scorer that ignores its input gets 0.5 +- 0.015 on 1500 rows
    assert summary["scored_rows"] == 1500
    assert summary["auc"] > 0.54 and 0.0 < summary["logloss"] < 0.69
    assert summary["eval_loss"] == summary["logloss"] and "accuracy" not in summary
    assert "train-000007.tar" in summary["held_out"] and summary["steps"] == 12
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == 12 and evals[-1]["auc"] == summary["auc"]
    assert (out / "curves.png").stat().st_size > 0
    assert "eval AUC" in proc.stdout and "eval logloss" in proc.stdout


def test_a_ctr_run_resumes_and_refuses_a_checkpoint_of_other_tables(click_shards, tmp_path):
    out = tmp_path / "run"
    _train(click_shards, out, "--steps", 6, "--checkpoint-every", 3)
    _train(click_shards, out, "--steps", 9, "--checkpoint-every", 3)
    assert json.loads((out / "summary.json").read_text())["resumed_at_step"] == 6
    other = run_tool("train", "--task", "ctr", "--data", click_shards, "--out", out,
                     "--batch-size", 128, "--num-buckets", 256, "--embedding-dim", 4,
                     "--steps", 12, "--quiet")
    assert other.returncode != 0 and "num_buckets" in other.stderr


def test_ctr_flags_are_checked_before_training(click_shards, tmp_path):
    wrong = _train(click_shards, tmp_path / "a", "--model", "voxnet", "--steps", 2,
                   check=False)
    assert wrong.returncode == 2 and "--model voxnet: choose one of dlrm, deepfm" in wrong.stderr
    # Held out by shard, the training loader reads part of the shards: rows per epoch unknown.
    epochs = _train(click_shards, tmp_path / "b", "--epochs", 1, check=False)
    assert epochs.returncode == 2 and "--epochs needs the loader's length" in epochs.stderr
    assert "pass --steps" in epochs.stderr


def test_one_epoch_over_whole_data_with_eval_data(click_shards, tmp_path):
    """--eval-data: fresh rows of the same click process as the training shards (another
    seed's process would share nothing to learn: AUC 0.5 whatever the model)."""
    root = tmp_path
    raw = root / "raw"
    raw.mkdir()
    held = draw_rows(Signal.of_seed(0), np.random.default_rng([0, 77]), 1500)
    (raw / "part-00000.tsv").write_text(format_rows(held, 0), encoding="ascii")
    run_tool("make_shards", "tabular", raw, root / "held", "--preset", "criteo",
             "--rows-per-block", 500, "--workers", 1, "--quiet", check=True)
    out = root / "run"
    _train(click_shards, out, "--epochs", 1, "--eval-data", root / "held")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == math.ceil(12_000 / 128)
    assert "--eval-data" in summary["held_out"] and summary["scored_rows"] == 1500
    achievable = data_side_auc(held.label, held.truth)  # scoring by the true probabilities
    assert achievable - 0.1 < summary["auc"] <= achievable + 0.02, (summary["auc"], achievable)


AVAZU_COLUMNS = ["id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain",
                 "site_category", "app_id", "app_domain", "app_category", "device_id",
                 "device_ip", "device_model", "device_type", "device_conn_type", "C14", "C15",
                 "C16", "C17", "C18", "C19", "C20", "C21"]


def test_avazu_style_logs_without_dense_columns_train(tmp_path):
    """Avazu's layout: a header, an id, the label `click`, every other column categorical;
    the click depends on site_category, so the model (DeepFM: no linear term, no dense part
    in its MLP) has something to find."""
    rng = np.random.default_rng(0)
    lines = [",".join(AVAZU_COLUMNS)]
    for i in range(3000):
        category = int(rng.integers(0, 8))
        click = int(rng.random() < (0.6 if category < 3 else 0.1))
        values = [f"{rng.integers(0, 50):08x}" for _ in AVAZU_COLUMNS[3:]]
        values[4] = f"cat{category}"  # site_category
        lines.append(",".join([str(10**18 + i), str(click), f"141021{i % 24:02d}", *values]))
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "train.csv").write_text("\n".join(lines) + "\n")
    run_tool("make_shards", "tabular", tmp_path / "raw", tmp_path / "shards", "--preset",
             "avazu", "--rows-per-block", 250, "--max-count", 2, "--workers", 1, "--quiet",
             check=True)
    out = tmp_path / "run"
    _train(tmp_path / "shards", out, "--model", "deepfm", "--steps", 40, "--lr", "1e-2")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["auc"] > 0.7, summary  # site_category alone separates 0.6 from 0.1


def _torchrun(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tools" / "train.py"), *map(str, args)],
        capture_output=True, text=True, timeout=300)


def test_two_gloo_ranks_train_ctr_and_rank_0_scores_the_whole_held_out_set(click_shards,
                                                                          tmp_path):
    common = ("--task", "ctr", "--data", click_shards, "--batch-size", 128, "--num-buckets",
              512, "--embedding-dim", 4, "--device", "cpu", "--quiet")
    proc = _torchrun(*common, "--out", tmp_path / "ddp", "--steps", 6)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(set(summary["parameter_digests"])) == 1
    # rank 0's summary scores the whole held-out shard, both ranks' shares, once each
    assert summary["scored_rows"] == 1500
    assert summary["auc"] > 0.5 and summary["logloss"] > 0
    refused = _torchrun(*common, "--out", tmp_path / "cpu", "--steps", 2,
                        "--embeddings-on-cpu")
    assert refused.returncode != 0 and "DDP cannot" in refused.stderr
