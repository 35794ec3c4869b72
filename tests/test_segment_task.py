"""The LiDAR segmentation task (trainers/segment_task.py): its two networks on ragged
batches, the IoU arithmetic against numpy, the bev model's projection from voxels to points,
and both models overfitting a tiny synthetic scene under the Trainer's step.

Batches are ScanBatch objects built here from torch tensors, voxelized as the loader's
docstring says (pipeline/loading/batch.py): the scene is ground at z = -1.7 m (class 1), a
car-sized box on it (class 2) and a few unlabelled points (class 0, the ignored one).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_tool

from shardflow.loading.batch import ScanBatch
from shardflow.tools.train import build_parser, evaluation_line
from shardflow.trainers.distributed import DistInfo
from shardflow.trainers.loop import TrainConfig, Trainer
from shardflow.trainers.run import fit
from shardflow.trainers.segment_metrics import SegTotals, metric_names, point_totals
from shardflow.trainers.segment_models import frame_index
from shardflow.trainers.segment_task import BevUNet, PointNetSeg, PointSegmentation, grid_cells
from shardflow.trainers.wiring import EvalSplit, TaskOptions, build_task, split_eval

CPU = torch.device("cpu")
RANGE = (-12.8, -12.8, -3.2, 12.8, 12.8, 3.2)  # 32 x 32 x 8 cells of 0.8 m
VOXEL = 0.8
NAMES = ["unlabeled", "road", "car"]


def scene(seed: int, ground: int = 300, box: int = 120, stray: int = 10
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(points (N, 3), labels (N,)): ground, a box standing on it somewhere, unlabelled
    points above, shuffled."""
    g = torch.Generator().manual_seed(seed)
    centre = torch.rand(2, generator=g) * 12 - 6
    flat = torch.rand(ground * 2, 2, generator=g) * 22 - 11
    flat = flat[((flat - centre).abs() > torch.tensor([2.2, 1.0])).any(1)][:ground]
    floor = torch.cat([flat, torch.full((len(flat), 1), -1.7)], 1)
    size = torch.tensor([4.0, 1.8, 1.5])
    low = torch.cat([centre - size[:2] / 2, torch.tensor([-1.6])])
    car = low + torch.rand(box, 3, generator=g) * size
    high = torch.rand(stray, 3, generator=g) * torch.tensor([20.0, 20.0, 1.0]) - \
        torch.tensor([10.0, 10.0, -1.5])
    points = torch.cat([floor, car, high])
    labels = torch.cat([torch.full((len(floor),), 1), torch.full((box,), 2),
                        torch.zeros(stray, dtype=torch.long)])
    order = torch.randperm(len(points), generator=g)
    return points[order].float(), labels[order]


def scan_batch(frames: list[tuple[torch.Tensor, torch.Tensor]], voxels: bool = False,
               point_range: tuple[float, ...] = RANGE) -> ScanBatch:
    sizes = torch.tensor([0] + [len(p) for p, _ in frames])
    points = torch.cat([p for p, _ in frames])
    batch = ScanBatch(points, torch.cumsum(sizes, 0), torch.cat([lb for _, lb in frames]),
                      [f"scan{i}" for i in range(len(frames))], ignore_label=0)
    if voxels:
        voxelize(batch, point_range, VOXEL)
    return batch


def voxelize(batch: ScanBatch, point_range: tuple[float, ...], size: float) -> None:
    """The voxel fields as the loader fills them (voxel_labels left to the ignore label:
    the task reads none of them)."""
    grid = grid_cells(point_range, (size,) * 3)
    cell = ((batch.points - torch.tensor(point_range[:3])) / size).floor().long()
    inside = ((cell >= 0) & (cell < torch.tensor(grid))).all(1)
    frame = frame_index(batch.offsets, len(batch.points))
    keys = torch.cat([frame[:, None], cell], 1)[inside]
    coords, row, counts = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
    batch.voxel_coords, batch.voxel_counts, batch.grid = coords, counts, grid
    batch.voxel_labels = torch.zeros(len(coords), dtype=torch.long)
    batch.point_voxel = torch.full((len(batch.points),), -1, dtype=torch.long)
    batch.point_voxel[inside] = row


def bev_task(**kw: object) -> PointSegmentation:
    return PointSegmentation(3, "bev", 0, CPU, NAMES, voxel_size=VOXEL, point_range=RANGE,
                             **kw)  # type: ignore[arg-type]


# -- shapes and independence --------------------------------------------------------------------

@pytest.mark.parametrize("frames", [1, 3])
def test_both_models_give_a_row_of_logits_per_point_of_ragged_frames(frames):
    torch.manual_seed(0)
    batch = scan_batch([scene(s, ground=100 + 40 * s, box=30 + 7 * s) for s in range(frames)],
                       voxels=True)
    points = len(batch.points)
    assert PointNetSeg(5, width=8)(batch.points, batch.offsets).shape == (points, 5)
    voxel_logits = BevUNet(5, batch.grid[2], width=8)(batch.voxel_coords, batch.voxel_counts,
                                                      frames, batch.grid)
    assert voxel_logits.shape == (len(batch.voxel_coords), 5)
    for task in (PointSegmentation(3, width=8), bev_task(width=8)):
        logits, _ = task._logits(batch)
        assert logits.shape == (points, 3) and torch.isfinite(logits).all()


def test_pointnet_is_invariant_to_the_order_of_a_frames_points():
    torch.manual_seed(0)
    net = PointNetSeg(3, width=8)
    batch = scan_batch([scene(0), scene(1)])
    order = torch.cat([torch.randperm(int(batch.offsets[1])),
                       torch.randperm(int(batch.offsets[2] - batch.offsets[1]))
                       + batch.offsets[1]])
    logits = net(batch.points, batch.offsets)
    shuffled = net(batch.points[order], batch.offsets)
    assert torch.allclose(shuffled, logits[order], atol=1e-5)


@pytest.mark.parametrize("model", ["pointnet", "bev"])
def test_a_frames_logits_do_not_depend_on_the_other_frames(model):
    """Frame 1 stays; frame 0 is replaced by a larger, different scene: frame 1's logits
    are the same (no padding, no statistics across the batch)."""
    torch.manual_seed(0)
    task = PointSegmentation(3, width=8) if model == "pointnet" else bev_task(width=8)
    kept = scene(7)
    before = scan_batch([scene(1, ground=80), kept], voxels=True)
    after = scan_batch([scene(2, ground=400, box=200), kept], voxels=True)
    a, _ = task._logits(before)
    b, _ = task._logits(after)
    assert torch.allclose(a[int(before.offsets[1]):], b[int(after.offsets[1]):], atol=1e-5)


def test_the_bev_model_projects_each_voxels_logits_to_its_points():
    torch.manual_seed(0)
    task = bev_task(width=8)
    points, labels = scene(3)
    far = torch.tensor([[30.0, 0.0, -1.7], [0.0, 0.0, 9.0]])  # beyond x; above the grid
    batch = scan_batch([(torch.cat([points, far]), torch.cat([labels, torch.tensor([1, 2])]))],
                       voxels=True)
    voxel_logits = task.model(batch.voxel_coords, batch.voxel_counts, 1, batch.grid)
    logits, inside = task._logits(batch)
    assert inside is not None and inside.sum() == len(points)  # the two far ones are out
    assert torch.equal(logits[inside], voxel_logits[batch.point_voxel[inside]])
    same = batch.point_voxel == batch.point_voxel[batch.voxel_counts[batch.point_voxel] > 1][0]
    assert same.sum() > 1 and (logits[same] == logits[same][0]).all()
    totals = task.evaluate(batch)
    assert totals.unpredicted == 2 and totals.loss_points == int((labels != 0).sum())


def test_bev_refuses_a_batch_without_voxels_or_of_another_grid():
    task = bev_task(width=8)
    with pytest.raises(ValueError, match="voxel_size"):
        task.forward(scan_batch([scene(0)]))
    other = scan_batch([scene(0)], voxels=True, point_range=(-6.4, -6.4, -3.2, 6.4, 6.4, 3.2))
    with pytest.raises(ValueError, match="same voxel_size and point_range"):
        task.forward(other)


def test_describe_holds_the_grid_so_another_grid_is_another_run():
    a = bev_task(width=8).describe()
    assert a == {"task": "pointcloud-seg", "model": "bev", "num_classes": 3,
                 "ignore_label": 0, "voxel_size": [0.8] * 3, "point_range": list(RANGE),
                 "grid": [32, 32, 8]}
    b = PointSegmentation(3, "bev", 0, CPU, voxel_size=(0.4, 0.4, 0.8), point_range=RANGE,
                          width=8).describe()
    assert b["grid"] == [64, 64, 8] and a != b
    assert PointSegmentation(3, width=8).describe()["grid"] is None
    assert grid_cells((-40, -40, -3, 40, 40, 3), (0.4,) * 3) == (200, 200, 15)
    assert PointSegmentation(3, "bev", width=8).grid == (200, 200, 15)  # the defaults


# -- the metrics --------------------------------------------------------------------------------

def numpy_iou(pred: np.ndarray, label: np.ndarray, k: int, ignore: int) -> dict[str, float]:
    """A plain confusion matrix; pred -1 (no prediction) is an extra column."""
    keep = label != ignore
    conf = np.zeros((k, k + 1), dtype=np.int64)  # rows: truth; columns: prediction, then none
    np.add.at(conf, (label[keep], np.where(pred[keep] < 0, k, pred[keep])), 1)
    out = {"accuracy": np.trace(conf[:, :k]) / conf.sum()}
    ious = []
    for c in range(k):
        if c == ignore:
            continue
        union = conf[c].sum() + conf[:, c].sum() - conf[c, c]
        out[f"iou_{c}"] = conf[c, c] / union if union else math.nan
        if union:
            ious.append(out[f"iou_{c}"])
    out["miou"] = float(np.mean(ious))
    return out


def test_iou_and_miou_match_a_plain_numpy_confusion_matrix():
    """Five classes, 0 ignored: class 4 is neither labelled nor predicted (left out of
    miou); class 3 is only predicted (IoU 0, in miou); points labelled 0 count nowhere, even
    where the prediction is class 1; two labelled points have no prediction."""
    label = np.array([1, 1, 1, 2, 2, 2, 2, 0, 0, 1, 2, 1])
    pred = np.array([1, 1, 2, 2, 2, 3, 1, 1, 3, 1, 2, 1])
    has = np.array([True] * 10 + [False] * 2)
    logits = torch.full((len(pred), 5), -5.0)
    logits[torch.arange(len(pred)), torch.from_numpy(pred)] = 5.0
    logits[:, 0] = 9.0  # the ignored class is never predicted, however high its logit
    totals = SegTotals(intersection=[0] * 5, union=[0] * 5)
    for part in (slice(0, 5), slice(5, 12)):  # two batches add up to the whole
        totals.add(point_totals(logits[part], torch.from_numpy(label[part]),
                                torch.from_numpy(has[part]), 0))
    got = totals.metrics()
    want = numpy_iou(np.where(has, pred, -1), label, 5, 0)
    assert set(got) == {"eval_loss", "accuracy", "miou", "iou_1", "iou_2", "iou_3", "iou_4",
                        "labelled_points", "unpredicted_points"}
    assert got["accuracy"] == pytest.approx(want["accuracy"]) == pytest.approx(5 / 10)
    for key in ("miou", "iou_1", "iou_2", "iou_3"):
        assert got[key] == pytest.approx(want[key]), key
    assert math.isnan(got["iou_4"]) and math.isnan(want["iou_4"])
    assert got["miou"] == pytest.approx((3 / 6 + 2 / 6 + 0) / 3)
    assert got["labelled_points"] == 10 and got["unpredicted_points"] == 2
    assert totals.over_ranks(DistInfo()) == pytest.approx(got, nan_ok=True)


def test_class_names_name_the_iou_keys_and_the_ignored_class_has_none():
    assert metric_names(3, ["unlabeled", "Traffic-sign", "other ground"]) == \
        ["unlabeled", "traffic_sign", "other_ground"]
    keys = PointSegmentation(3, class_names=NAMES, width=8).new_totals().metrics()
    assert {k for k in keys if k.startswith("iou_")} == {"iou_road", "iou_car"}
    assert all(math.isnan(keys[k]) for k in ("eval_loss", "accuracy", "miou"))


# -- training -----------------------------------------------------------------------------------

def overfit(task: PointSegmentation, batch: ScanBatch, tmp_path: Path, steps: int
            ) -> tuple[float, float, dict[str, float]]:
    """(first loss, last loss, metrics) after `steps` of the Trainer's step on one batch."""
    cfg = TrainConfig(run_dir=tmp_path, steps=steps, warmup=0, precision="fp32", lr=3e-3)
    trainer = Trainer(task, loader=None, cfg=cfg, device=CPU, fingerprint={})
    losses = [float(trainer.micro_step(batch)) for _ in range(steps)]  # type: ignore[arg-type]
    return losses[0], losses[-1], trainer.evaluate([batch])


@pytest.mark.parametrize("model", ["pointnet", "bev"])
def test_both_models_overfit_a_tiny_scene(model, tmp_path):
    """60 steps on two frames: the loss falls by a large factor and the mIoU ends far above
    what the majority class (road) alone scores."""
    torch.manual_seed(0)
    task = PointSegmentation(3, width=16) if model == "pointnet" else bev_task(width=16)
    batch = scan_batch([scene(0), scene(1)], voxels=model == "bev")
    first, last, metrics = overfit(task, batch, tmp_path, 60)
    labelled = batch.labels[batch.labels != 0]
    road = float((labelled == 1).float().mean())  # majority: IoU(road) = its share, car 0
    print(f"{model}: loss {first:.3f} -> {last:.4f}, {metrics}")
    assert last < first / 10
    assert metrics["miou"] > 0.95 > road / 2 and metrics["accuracy"] > 0.97
    with torch.no_grad():
        assert metrics["eval_loss"] == pytest.approx(float(task.forward(batch).loss), rel=1e-4)


# -- wiring -------------------------------------------------------------------------------------

def test_segmentation_flags_are_refused_where_they_mean_nothing(tmp_path):
    from shardflow.loading.shardlist import Source

    empty = Source((), None, "pointcloud", None)
    split = EvalSplit(empty, empty, "none")
    for task, extra, match in (
            ("pointcloud", {"voxel_size": (0.4,) * 3}, "for --task pointcloud-seg"),
            ("image", {"frame_points": 100}, "for --task pointcloud-seg"),
            ("pointcloud-seg", {"voxel_size": (0.4,) * 3}, "--model bev"),
            ("pointcloud-seg", {"model": "voxnet"}, "pointnet, bev")):
        opts = TaskOptions(task=task, data=str(tmp_path), use_tuning=False,
                           **extra)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=match):
            build_task(opts, split, 0, 1)


def test_train_py_parses_the_segmentation_flags_into_task_options():
    args = build_parser().parse_args([
        "--task", "pointcloud-seg", "--model", "bev", "--data", "d", "--out", "o", "--steps",
        "1", "--voxel-size", "0.2,0.2,0.4", "--point-range", "-40", "-40", "-3", "40", "40",
        "3", "--frame-points", "all"])
    assert args.voxel_size == (0.2, 0.2, 0.4) and args.frame_points == 0
    assert tuple(args.point_range) == (-40, -40, -3, 40, 40, 3)
    assert build_parser().parse_args(["--task", "pointcloud-seg", "--data", "d", "--out", "o",
                                      "--steps", "1", "--voxel-size", "0.5"]
                                     ).voxel_size == (0.5, 0.5, 0.5)


class OneScene:
    """A loader of one batch, over and over (five to a pass): what `fit` reads of a loader."""

    epoch = 0

    def __init__(self, batch: ScanBatch) -> None:
        self.batch = batch

    def __iter__(self):
        yield from [self.batch] * 5

    def state_dict(self) -> dict[str, int]:
        return {}

    def skipped_samples(self) -> int:
        return 0

    def skipped_of_unknown_size(self) -> int:
        return 0


def test_fit_writes_miou_and_each_class_iou_to_the_summary_and_eval_log(tmp_path):
    """...and a checkpoint of that run is refused by a task on another grid."""
    torch.manual_seed(0)
    task = bev_task(width=8)
    batch = scan_batch([scene(0), scene(1)], voxels=True)
    cfg = TrainConfig(run_dir=tmp_path, steps=10, warmup=0, precision="fp32", log_every=5,
                      checkpoint_every=5)
    summary = fit(Trainer(task, OneScene(batch), cfg, CPU, {}), eval_loader=[batch])
    saved = json.loads((tmp_path / "summary.json").read_text())
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    for record in (summary, saved, evals[-1]):
        assert {"miou", "iou_road", "iou_car", "accuracy", "labelled_points"} <= set(record)
        assert "iou_unlabeled" not in record and 0 <= record["miou"] <= 1
    assert evaluation_line(saved).startswith("eval mIoU ")
    assert (tmp_path / "curves.png").is_file() or importlib.util.find_spec("matplotlib") is None
    finer = PointSegmentation(3, "bev", 0, CPU, NAMES, voxel_size=(0.4, 0.4, 0.8),
                              point_range=RANGE, width=8)
    with pytest.raises(ValueError, match=r"grid: \[32, 32, 8\] there, \[64, 64, 8\] here"):
        Trainer(finer, OneScene(batch), cfg, CPU, {}).resume()


@pytest.fixture(scope="module")
def scan_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ray-cast street scans (pipeline/builtin/lidar.py) converted with the learning map."""
    from shardflow.builtin.lidar import CONFIG, make_lidar_scans

    root = tmp_path_factory.mktemp("scans")
    make_lidar_scans(root / "kitti", frames=4, beams=16, azimuth_steps=360)
    run_tool("make_shards", "pointcloud", root / "kitti", root / "shards", "--layout", "kitti",
             "--learning-map", root / "kitti" / CONFIG, "--max-count", 2, "--quiet",
             check=True)
    return root / "shards"


@pytest.mark.parametrize("model", ["pointnet", "bev"])
def test_build_task_reads_the_classes_and_the_grid_from_the_real_loader(scan_shards, model):
    """build_task as train.py calls it: the classes, ignored label and names come from the
    manifest through the loader; a training batch trains, the held-out one evaluates."""
    from shardflow.loading.shardlist import resolve_source

    opts = TaskOptions(task="pointcloud-seg", data=str(scan_shards), model=model,
                       batch_size=2, device="cpu", backend="portable", use_tuning=False,
                       loader_threads=1)
    built = build_task(opts, split_eval(resolve_source(str(scan_shards)), None), 0, 1)
    try:
        task = built.task
        assert (task.num_classes, task.ignore_label) == (7, 0)
        assert task.class_names[:3] == ["unlabeled", "car", "road"]
        assert task.describe()["grid"] == (None if model == "pointnet" else [200, 200, 15])
        batch = next(iter(built.loader))
        assert isinstance(batch, ScanBatch) and torch.isfinite(task.forward(batch).loss)
        totals = task.new_totals()
        for held in built.evaluation:
            totals.add(task.evaluate(held))
        metrics = totals.metrics()
        assert metrics["labelled_points"] > 0 and 0 <= metrics["miou"] <= 1
        assert "iou_car" in metrics and "iou_unlabeled" not in metrics
    finally:
        built.loader.close()
        built.evaluation.close()
