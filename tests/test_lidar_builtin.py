"""Tests for the synthetic SemanticKITTI-layout LiDAR scans of shardflow.builtin.lidar."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardflow.builtin import make_lidar_scans
from shardflow.builtin.lidar import (
    BUILDING,
    CAR,
    CLASS_NAMES,
    CLEARANCE,
    GROUND_Z,
    IGNORE_LABEL,
    MAX_RANGE,
    POLE,
    RANGE_NOISE,
    ROAD,
    TERRAIN,
    VEGETATION,
    Scene,
    beam_rays,
    cast,
    draw_scene,
    lateral,
    scan_frame,
)

SMALL = {"frames": 2, "beams": 16, "azimuth_steps": 360}
TOLERANCE = 5 * RANGE_NOISE  # noise along the ray, five sigmas: no point of a frame goes past


# The two readers are those of SemanticKITTI's API (auxiliary/laserscan.py), which reads the
# labels as int32: the same values while instance ids stay below 2**15.
def read_scan(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.float32).reshape((-1, 4))


def read_label(path: Path) -> tuple[np.ndarray, np.ndarray]:
    label = np.fromfile(path, dtype=np.int32).reshape(-1)
    return label & 0xFFFF, label >> 16


def in_box(box: np.ndarray, xyz: np.ndarray, grow: float) -> np.ndarray:
    cx, cy, cz, hx, hy, hz, yaw = box
    x, y, z = xyz[:, 0] - cx, xyz[:, 1] - cy, xyz[:, 2] - cz
    along, across = x * np.cos(yaw) + y * np.sin(yaw), y * np.cos(yaw) - x * np.sin(yaw)
    return (np.abs(along) <= hx + grow) & (np.abs(across) <= hy + grow) & (np.abs(z) <= hz + grow)


def in_pole(pole: np.ndarray, xyz: np.ndarray, grow: float) -> np.ndarray:
    cx, cy, radius, height = pole
    z = xyz[:, 2] - GROUND_Z
    return ((np.hypot(xyz[:, 0] - cx, xyz[:, 1] - cy) <= radius + grow)
            & (z >= -grow) & (z <= height + grow))


def in_tree(tree: np.ndarray, xyz: np.ndarray, grow: float) -> np.ndarray:
    return (((xyz - tree[:3]) / (tree[3:] + grow)) ** 2).sum(axis=1) <= 1


def in_anything(scene: Scene, xyz: np.ndarray, grow: float) -> np.ndarray:
    """Inside (or under) some object of ``scene`` grown by ``grow`` (negative: shrunk)."""
    inside = xyz[:, 2] < GROUND_Z - grow
    for test, rows in ((in_box, scene.boxes), (in_pole, scene.poles), (in_tree, scene.trees)):
        for row in rows:
            inside |= test(row, xyz, grow)
    return inside


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lidar_scans(tmp_path_factory.mktemp("lidar") / "kitti", seed=3, **SMALL)


@pytest.fixture(scope="module")
def frame() -> tuple[Scene, np.ndarray, np.ndarray, np.ndarray]:
    """One default-size frame, with its scene (the same generator state draws it first)."""
    scene = draw_scene(np.random.default_rng(11))
    points, labels = scan_frame(np.random.default_rng(11))
    return scene, points, labels & 0xFFFF, labels >> 16


def test_files_are_in_the_semantickitti_layout_with_matching_sizes(small: Path):
    sequence = small / "sequences" / "00"
    bins = sorted(p.name for p in (sequence / "velodyne").iterdir())
    labels = sorted(p.name for p in (sequence / "labels").iterdir())
    assert bins == ["000000.bin", "000001.bin"]
    assert labels == ["000000.label", "000001.label"]
    for index in range(SMALL["frames"]):
        scan_path = sequence / "velodyne" / f"{index:06d}.bin"
        label_path = sequence / "labels" / f"{index:06d}.label"
        points, (semantic, _) = read_scan(scan_path), read_label(label_path)
        assert len(points) > 1000
        assert scan_path.stat().st_size == 16 * len(points)
        assert label_path.stat().st_size == 4 * len(semantic)
        assert np.isfinite(points).all()
        assert (points[:, 3] >= 0).all() and (points[:, 3] <= 1).all()
    assert (small / "semantic-demo.yaml").is_file()


def test_the_config_maps_every_raw_id_in_the_labels(small: Path):
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((small / "semantic-demo.yaml").read_text())
    learning_map, inverse = config["learning_map"], config["learning_map_inv"]
    found = np.unique(np.concatenate([read_label(p)[0] for p in small.rglob("*.label")]))
    assert set(found.tolist()) <= set(learning_map) <= set(config["labels"])
    assert learning_map[0] == IGNORE_LABEL == 0
    assert sorted(learning_map.values()) == list(range(len(CLASS_NAMES)))
    assert {train: raw for raw, train in learning_map.items()} == inverse
    assert [config["labels"][inverse[i]] for i in range(len(CLASS_NAMES))] == CLASS_NAMES
    assert config["learning_ignore"][0] is True
    assert not any(config["learning_ignore"][i] for i in range(1, len(CLASS_NAMES)))


def test_a_default_frame_has_every_class_and_a_rare_ignore_label(frame):
    _, points, semantic, _ = frame
    assert 50_000 <= len(points) <= 120_000
    assert set(np.unique(semantic).tolist()) == {0, CAR, ROAD, BUILDING, VEGETATION, TERRAIN,
                                                 POLE}
    assert 0 < np.mean(semantic == 0) < 0.02
    assert points.dtype == np.float32


def test_every_point_is_within_range_and_the_ground_is_flat(frame):
    _, points, semantic, instance = frame
    assert np.linalg.norm(points[:, :3], axis=1).max() <= MAX_RANGE
    ground = np.isin(semantic, [ROAD, TERRAIN])
    assert np.abs(points[ground, 2] - GROUND_Z).max() < TOLERANCE
    assert points[~ground, 2].min() > GROUND_Z - TOLERANCE
    # Objects stand up: most of their points are well above the ground.
    objects = np.isin(semantic, [CAR, POLE, BUILDING, VEGETATION])
    assert np.median(points[objects, 2]) > GROUND_Z + 0.5
    assert (instance[np.isin(semantic, [ROAD, TERRAIN, VEGETATION])] == 0).all()


def test_box_points_lie_in_their_own_box(frame):
    scene, points, semantic, instance = frame
    things = np.isin(semantic, [CAR, BUILDING])
    assert len(np.unique(instance[semantic == CAR])) >= 2
    for k in range(len(scene.boxes)):
        mine = things & (instance == k + 1)
        assert (semantic[mine] == scene.box_classes[k]).all()
        assert in_box(scene.boxes[k], points[mine, :3], TOLERANCE).all()
    assert (instance[things] >= 1).all() and (instance[things] <= len(scene.boxes)).all()


def test_pole_and_tree_points_lie_on_their_objects(frame):
    scene, points, semantic, instance = frame
    first = len(scene.boxes) + 1
    assert (semantic[np.isin(instance, first + np.arange(len(scene.poles)))] == POLE).all()
    for p in range(len(scene.poles)):
        mine = (semantic == POLE) & (instance == first + p)
        assert in_pole(scene.poles[p], points[mine, :3], TOLERANCE).all()
    trees = points[semantic == VEGETATION, :3]
    assert np.any([in_tree(tree, trees, TOLERANCE) for tree in scene.trees], axis=0).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_each_exact_hit_is_on_its_object_and_nearest(seed: int):
    """Without noise a hit lies on the surface of the object its label names, and nothing
    stands between it and the sensor (samples along the way are inside no object); a ray
    that misses crosses no object within 100 m."""
    scene = draw_scene(np.random.default_rng(seed))
    rays = beam_rays(24, 720)
    t, labels = cast(scene, rays)
    hit = np.isfinite(t)
    xyz, semantic, instance = rays[hit] * t[hit, None], labels[hit] & 0xFFFF, labels[hit] >> 16
    ground = np.isin(semantic, [ROAD, TERRAIN])
    assert np.abs(xyz[ground, 2] - GROUND_Z).max() < 1e-9
    on_road = np.abs(lateral(scene.road, xyz[:, 0], xyz[:, 1])) < scene.road[2]
    assert ((semantic == ROAD) == (ground & on_road)).all()
    objects = [(in_box, row) for row in scene.boxes] + [(in_pole, row) for row in scene.poles]
    for number, (test, row) in enumerate(objects, start=1):
        mine = xyz[instance == number]
        assert test(row, mine, 1e-6).all() and not test(row, mine, -1e-6).any()
    trees = xyz[semantic == VEGETATION]
    assert np.any([in_tree(tree, trees, 1e-6) for tree in scene.trees], axis=0).all()
    way = np.linspace(0.02, 0.98, 25)[:, None]
    ranges = np.where(hit, t, 100.0)
    samples = (rays[None] * (way * ranges)[..., None]).reshape(-1, 3)
    assert not in_anything(scene, samples, -1e-6).any()


def test_nothing_stands_near_the_sensor():
    for seed in range(20):
        scene = draw_scene(np.random.default_rng(seed))
        cx, cy, _, hx, hy, _, yaw = scene.boxes.T
        # The sensor in each box's frame, then its distance to the box's footprint.
        along = -(cx * np.cos(yaw) + cy * np.sin(yaw))
        across = -(cy * np.cos(yaw) - cx * np.sin(yaw))
        gap = np.hypot(np.maximum(np.abs(along) - hx, 0), np.maximum(np.abs(across) - hy, 0))
        assert (gap >= CLEARANCE).all()
        pole_gap = np.hypot(scene.poles[:, 0], scene.poles[:, 1]) - scene.poles[:, 2]
        tree_gap = np.hypot(scene.trees[:, 0], scene.trees[:, 1]) - scene.trees[:, 3:5].max(1)
        assert (pole_gap >= CLEARANCE).all() and (tree_gap >= CLEARANCE).all()


def test_same_seed_same_bytes_other_seed_or_sequence_other_bytes(small: Path, tmp_path: Path):
    again = make_lidar_scans(tmp_path / "again", seed=3, **SMALL)
    other = make_lidar_scans(tmp_path / "other", seed=4, **SMALL)
    assert _contents(again) == _contents(small)
    assert _contents(other).keys() == _contents(small).keys()
    for name, data in _contents(other).items():
        if name.endswith((".bin", ".label")):
            assert data != _contents(small)[name]
    make_lidar_scans(again, seed=3, sequence="01", **SMALL)
    first = (again / "sequences" / "00" / "velodyne" / "000000.bin").read_bytes()
    assert (again / "sequences" / "01" / "velodyne" / "000000.bin").read_bytes() != first


def test_bad_arguments_are_refused(small: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="not empty"):
        make_lidar_scans(small, **SMALL)
    with pytest.raises(ValueError, match="at least 1"):
        make_lidar_scans(tmp_path / "none", frames=0)
    with pytest.raises(ValueError, match="folder name"):
        make_lidar_scans(tmp_path / "bad", sequence="../00")
