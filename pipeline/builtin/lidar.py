"""Synthetic LiDAR scans in the SemanticKITTI layout, for LiDAR-segmentation demos and tests.

    draw_scene(rng)                   a road, cars, poles, buildings and trees around the sensor
        |
    beam_rays(beams, azimuth_steps)   unit rays: elevation -25..+3 degrees, azimuth 360 degrees
        |
    cast(scene, rays)                 exact range and raw label of each ray's nearest hit
        |
    scan(scene, rng, ...)             Gaussian range noise; misses and hits past 60 m dropped;
        |                             remission per class; 0.5 % of points relabelled unlabeled
    make_lidar_scans(root, ...)       root/sequences/<seq>/velodyne/NNNNNN.bin   float32 (N, 4)
                                      root/sequences/<seq>/labels/NNNNNN.label   uint32 (N,)
                                      root/semantic-demo.yaml   labels, learning_map(_inv)

Points are in the sensor frame, as in KITTI: x forward, y left, z up, the sensor 1.73 m above
the ground plane z = -1.73. A ``.bin`` holds x, y, z, remission as little-endian float32 rows
(``np.fromfile(path, np.float32).reshape(-1, 4)``); a ``.label`` holds one uint32 per point,
the raw semantic id in the low 16 bits and an instance id in the high 16 bits (each car, pole
and building its own, 0 for ground and vegetation). Raw ids are SemanticKITTI's; the yaml maps
them to training ids 0..6 with 0 (unlabeled) the ignored class, as SemanticKITTI does.

Every frame is a new scene (not a drive: consecutive frames are unrelated). Frame ``i`` of
sequence ``s`` draws from ``default_rng([seed, i, crc32(s)])``, so the same arguments give the
same bytes and two sequences of one seed differ.
"""

from __future__ import annotations

import logging
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from .images import fresh_out_dir

log = logging.getLogger(__name__)

SENSOR_HEIGHT = 1.73
GROUND_Z = -SENSOR_HEIGHT
ELEVATION_DEG = (-25.0, 3.0)
MAX_RANGE = 60.0
RANGE_NOISE = 0.02  # metres, along the ray
REMISSION_NOISE = 0.05
UNLABELED_SHARE = 0.005  # points whose label an annotator left out
CLEARANCE = 3.0  # no footprint comes nearer the sensor than this, in xy
PLACE_TRIES = 50
CHUNK = 16_384  # rays cast at once: keeps (rays x objects) arrays to a few MB
CONFIG = "semantic-demo.yaml"

UNLABELED, CAR, ROAD, BUILDING, VEGETATION, TERRAIN, POLE = 0, 10, 40, 50, 70, 72, 80
# Raw id -> name, in training-id order (SemanticKITTI's relative order of these classes).
RAW_NAMES = {UNLABELED: "unlabeled", CAR: "car", ROAD: "road", BUILDING: "building",
             VEGETATION: "vegetation", TERRAIN: "terrain", POLE: "pole"}
LEARNING_MAP = {raw: train for train, raw in enumerate(RAW_NAMES)}
CLASS_NAMES = list(RAW_NAMES.values())
IGNORE_LABEL = 0
# SemanticKITTI's colours (BGR), so its visualisers show these classes as they show KITTI.
COLOR_MAP = {UNLABELED: (0, 0, 0), CAR: (245, 150, 100), ROAD: (255, 0, 255),
             BUILDING: (0, 200, 255), VEGETATION: (0, 175, 0), TERRAIN: (80, 240, 150),
             POLE: (150, 240, 255)}
REMISSION = {UNLABELED: 0.0, CAR: 0.3, ROAD: 0.15, BUILDING: 0.4, VEGETATION: 0.5,
             TERRAIN: 0.3, POLE: 0.6}

Where = Literal["road", "roadside", "off_road"]
Road = tuple[float, float, float]  # heading (rad), offset of its centre line, half width (m)
Spot = tuple[float, float, float]  # a footprint circle: x, y, radius


@dataclass(frozen=True)
class Scene:
    """The objects of one frame, in the sensor frame (metres, radians).

    ``boxes`` (K, 7): centre x, y, z, half sizes x, y, z and yaw about z, with ``box_classes``
    (K,) their raw ids (CAR or BUILDING); ``poles`` (P, 4): axis x, y, radius, height above the
    ground; ``trees`` (T, 6): centre x, y, z and semi-axes x, y, z of axis-aligned ellipsoids.
    Box ``k`` has instance id ``k + 1`` and pole ``p`` has ``K + p + 1``.
    """

    road: Road
    boxes: np.ndarray
    box_classes: np.ndarray
    poles: np.ndarray
    trees: np.ndarray


def lateral(road: Road, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Signed distance of points from the road's centre line (the road is |lateral| < half)."""
    heading, offset, _ = road
    return -np.sin(heading) * x + np.cos(heading) * y - offset


def _propose(rng: np.random.Generator, road: Road, where: Where, near: float, far: float
             ) -> tuple[float, float]:
    heading, offset, half = road
    if where == "off_road":
        angle, distance = rng.uniform(0, 2 * np.pi), rng.uniform(near, far)
        return distance * np.cos(angle), distance * np.sin(angle)
    along = rng.uniform(-far, far)
    if where == "road":
        across = offset + rng.uniform(-1, 1) * (half - 1.0)
    else:  # a street light or sign just beyond the kerb, on either side
        across = offset + rng.choice([-1.0, 1.0]) * (half + rng.uniform(0.5, 2.5))
    return (along * np.cos(heading) - across * np.sin(heading),
            along * np.sin(heading) + across * np.cos(heading))


def _place(rng: np.random.Generator, taken: list[Spot], road: Road, radius: float,
           span: tuple[float, float], where: Where) -> tuple[float, float] | None:
    """A spot for a footprint circle of ``radius`` clear of the sensor and of ``taken`` (and
    of the road unless ``where`` is "road"); None after PLACE_TRIES misses."""
    for _ in range(PLACE_TRIES):
        x, y = _propose(rng, road, where, *span)
        if np.hypot(x, y) - radius < CLEARANCE:
            continue
        off_centre = abs(float(lateral(road, np.array(x), np.array(y))))
        if where != "road" and off_centre < road[2] + radius:
            continue
        if all(np.hypot(x - tx, y - ty) >= radius + tr for tx, ty, tr in taken):
            taken.append((x, y, radius))
            return x, y
    return None


def _buildings(rng: np.random.Generator, road: Road, taken: list[Spot]) -> list[list[float]]:
    rows = []
    for _ in range(rng.integers(2, 6)):
        half_x, half_y = rng.uniform(4.0, 12.5, 2)
        height, yaw = rng.uniform(6.0, 15.0), road[0] + rng.normal(0, 0.15)  # facing the road
        spot = _place(rng, taken, road, float(np.hypot(half_x, half_y)), (15.0, 50.0), "off_road")
        if spot:
            rows.append([*spot, GROUND_Z + height / 2, half_x, half_y, height / 2, yaw])
    return rows


def _cars(rng: np.random.Generator, road: Road, taken: list[Spot]) -> list[list[float]]:
    rows = []
    for _ in range(rng.integers(4, 11)):
        length, width, height = rng.uniform(3.9, 4.5), rng.uniform(1.7, 1.9), rng.uniform(1.4, 1.6)
        on_road = rng.random() < 0.6
        # On the road cars drive along it either way; parked ones off it stand at any angle.
        if on_road:
            yaw = road[0] + rng.choice([0.0, np.pi]) + rng.normal(0, 0.05)
        else:
            yaw = rng.uniform(0, 2 * np.pi)
        radius = float(np.hypot(length, width)) / 2
        where: Where = "road" if on_road else "off_road"
        spot = _place(rng, taken, road, radius, (CLEARANCE, 40.0), where)
        if spot:
            rows.append([*spot, GROUND_Z + height / 2, length / 2, width / 2, height / 2, yaw])
    return rows


def _poles(rng: np.random.Generator, road: Road, taken: list[Spot]) -> list[list[float]]:
    rows = []
    for _ in range(rng.integers(3, 9)):
        radius, height = rng.uniform(0.1, 0.2), rng.uniform(4.0, 8.0)
        spot = _place(rng, taken, road, radius, (CLEARANCE, 35.0), "roadside")
        if spot:
            rows.append([*spot, radius, height])
    return rows


def _trees(rng: np.random.Generator, road: Road, taken: list[Spot]) -> list[list[float]]:
    rows = []
    for _ in range(rng.integers(3, 11)):
        axes = rng.uniform(1.5, 3.0, 3)
        above = rng.uniform(2.0, 4.0)  # crown centre over the ground; low crowns are bushes
        spot = _place(rng, taken, road, float(axes[:2].max()), (CLEARANCE, 45.0), "off_road")
        if spot:
            rows.append([*spot, GROUND_Z + above, *axes])
    return rows


def draw_scene(rng: np.random.Generator) -> Scene:
    """A random street scene around the sensor; nothing stands within CLEARANCE of it in xy."""
    road = (float(rng.uniform(0, np.pi)), float(rng.uniform(-2.0, 2.0)),
            float(rng.uniform(4.0, 7.0)))
    taken: list[Spot] = []
    # The largest footprints go first, while the ground is still free.
    buildings = _buildings(rng, road, taken)
    cars = _cars(rng, road, taken)
    poles, trees = _poles(rng, road, taken), _trees(rng, road, taken)
    classes = [CAR] * len(cars) + [BUILDING] * len(buildings)
    return Scene(road=road, boxes=np.array(cars + buildings, dtype=np.float64).reshape(-1, 7),
                 box_classes=np.array(classes, dtype=np.uint32),
                 poles=np.array(poles, dtype=np.float64).reshape(-1, 4),
                 trees=np.array(trees, dtype=np.float64).reshape(-1, 6))


def beam_rays(beams: int, azimuth_steps: int) -> np.ndarray:
    """(beams * azimuth_steps, 3) unit directions, beam-major from the top beam down, each beam
    sweeping counter-clockwise from +x: the row order of a range image."""
    elevation = np.radians(np.linspace(ELEVATION_DEG[1], ELEVATION_DEG[0], beams))
    azimuth = 2 * np.pi * np.arange(azimuth_steps) / azimuth_steps
    el, az = np.meshgrid(elevation, azimuth, indexing="ij")
    rays = np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], axis=-1)
    return rays.reshape(-1, 3)


def _nearest(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per ray (row), the nearest hit distance among objects (columns) and its column."""
    if t.shape[1] == 0:
        return np.full(len(t), np.inf), np.zeros(len(t), dtype=np.int64)
    index = t.argmin(axis=1)
    return t[np.arange(len(t)), index], index


def _hit_ground(rays: np.ndarray) -> np.ndarray:
    down = rays[:, 2] < 0
    return np.divide(GROUND_Z, rays[:, 2], out=np.full(len(rays), np.inf), where=down)


def _hit_boxes(rays: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slab method in each box's frame: the sensor sits at -centre and the rays turn by -yaw."""
    cx, cy, cz, hx, hy, hz, yaw = boxes.T
    cos, sin = np.cos(yaw), np.sin(yaw)
    origin = (-(cos * cx + sin * cy), -(cos * cy - sin * cx), -cz)
    dx, dy, dz = rays[:, :1], rays[:, 1:2], rays[:, 2:3]
    shape = (len(rays), len(cz))
    direction = (dx * cos + dy * sin, dy * cos - dx * sin, np.broadcast_to(dz, shape))
    t_near, t_far = np.full(shape, -np.inf), np.full(shape, np.inf)
    # A ray parallel to a slab gets +-inf for both planes: outside it never enters, as it should.
    with np.errstate(divide="ignore", invalid="ignore"):
        for o, d, half in zip(origin, direction, (hx, hy, hz), strict=True):
            t1, t2 = (-half - o) / d, (half - o) / d
            t_near = np.maximum(t_near, np.minimum(t1, t2))
            t_far = np.minimum(t_far, np.maximum(t1, t2))
    return _nearest(np.where((t_near <= t_far) & (t_near > 0), t_near, np.inf))


def _hit_poles(rays: np.ndarray, poles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entry into each infinite vertical cylinder, kept where it lies between the ground and
    the top. Caps need no test: tops stand above the sensor, so no ray sees one from above."""
    cx, cy, radius, height = poles.T
    a = rays[:, :1] ** 2 + rays[:, 1:2] ** 2  # |d_xy|^2; no beam is vertical
    half_b = rays[:, :1] * cx + rays[:, 1:2] * cy
    disc = half_b**2 - a * (cx**2 + cy**2 - radius**2)
    t = (half_b - np.sqrt(np.maximum(disc, 0.0))) / a
    z = t * rays[:, 2:3]
    hit = (disc >= 0) & (t > 0) & (z >= GROUND_Z) & (z <= GROUND_Z + height)
    return _nearest(np.where(hit, t, np.inf))


def _hit_trees(rays: np.ndarray, trees: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scaling by the semi-axes turns each ellipsoid into the unit sphere (t is unchanged)."""
    axes = trees[:, 3:]
    origin = -trees[:, :3] / axes
    d = rays[:, None, :] / axes
    a = (d**2).sum(axis=-1)
    half_b = (d * origin).sum(axis=-1)
    disc = half_b**2 - a * ((origin**2).sum(axis=-1) - 1.0)
    t = (-half_b - np.sqrt(np.maximum(disc, 0.0))) / a
    return _nearest(np.where((disc >= 0) & (t > 0), t, np.inf))


def _cast_chunk(scene: Scene, rays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    box_t, box_i = _hit_boxes(rays, scene.boxes)
    pole_t, pole_i = _hit_poles(rays, scene.poles)
    tree_t, _ = _hit_trees(rays, scene.trees)
    ts = np.stack([_hit_ground(rays), box_t, pole_t, tree_t], axis=1)
    kind = ts.argmin(axis=1)
    t = ts[np.arange(len(rays)), kind]
    hit = rays * np.where(np.isfinite(t), t, 0.0)[:, None]
    on_road = np.abs(lateral(scene.road, hit[:, 0], hit[:, 1])) < scene.road[2]
    ground = np.where(on_road, ROAD, TERRAIN).astype(np.uint32)
    box = np.zeros(len(rays), dtype=np.uint32)
    if len(scene.boxes):
        box = scene.box_classes[box_i] | ((box_i + 1).astype(np.uint32) << 16)
    pole = POLE | ((len(scene.boxes) + pole_i + 1).astype(np.uint32) << 16)
    labels = np.choose(kind, [ground, box, pole, np.full(len(rays), VEGETATION, np.uint32)])
    return t, labels.astype(np.uint32)


def cast(scene: Scene, rays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact distance to each ray's nearest hit (inf for a miss) and its raw label (semantic
    id | instance << 16; meaningless for a miss). Rays are unit vectors from the sensor."""
    parts = [_cast_chunk(scene, rays[i:i + CHUNK]) for i in range(0, len(rays), CHUNK)]
    if not parts:
        return np.empty(0), np.empty(0, dtype=np.uint32)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _remission(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
    table = np.zeros(1 << 16)
    table[list(REMISSION)] = list(REMISSION.values())
    value = table[labels & 0xFFFF] + rng.normal(0.0, REMISSION_NOISE, len(labels))
    return np.clip(value, 0.0, 1.0)


def scan(scene: Scene, rng: np.random.Generator, beams: int, azimuth_steps: int
         ) -> tuple[np.ndarray, np.ndarray]:
    """Scan ``scene``: points float32 (N, 4) (x, y, z, remission) and raw labels uint32 (N,),
    in range-image order; rays that miss or land past MAX_RANGE (after noise) are dropped."""
    rays = beam_rays(beams, azimuth_steps)
    t, labels = cast(scene, rays)
    noisy = t + rng.normal(0.0, RANGE_NOISE, len(t))
    keep = noisy <= MAX_RANGE  # inf (a miss) fails too
    rays, noisy, labels = rays[keep], noisy[keep], labels[keep]
    remission = _remission(rng, labels)
    labels = np.where(rng.random(len(labels)) < UNLABELED_SHARE, UNLABELED, labels)
    points = np.column_stack([rays * noisy[:, None], remission]).astype(np.float32)
    return points, labels.astype(np.uint32)


def scan_frame(rng: np.random.Generator, beams: int = 48, azimuth_steps: int = 1800
               ) -> tuple[np.ndarray, np.ndarray]:
    """One frame: a new scene from ``rng``, scanned. ``draw_scene(rng)`` is the scene that the
    same generator state gives, for checking points against their objects."""
    return scan(draw_scene(rng), rng, beams, azimuth_steps)


def config_yaml() -> str:
    """The SemanticKITTI-style config: labels, color_map, learning_map(_inv), learning_ignore."""
    lines = ["# Built-in demo LiDAR data (shardflow.builtin.lidar); SemanticKITTI's raw ids.",
             "labels:", *(f"  {raw}: {name}" for raw, name in RAW_NAMES.items()),
             "color_map: # bgr", *(f"  {raw}: [{b}, {g}, {r}]" for raw, (b, g, r)
                                   in COLOR_MAP.items()),
             "learning_map:", *(f"  {raw}: {train}" for raw, train in LEARNING_MAP.items()),
             "learning_map_inv:", *(f"  {train}: {raw}" for raw, train in LEARNING_MAP.items()),
             "learning_ignore:", *(f"  {train}: {str(train == IGNORE_LABEL).lower()}"
                                   for train in LEARNING_MAP.values())]
    return "\n".join(lines) + "\n"


def _check(frames: int, beams: int, azimuth_steps: int, sequence: str) -> None:
    if frames < 1 or beams < 1 or azimuth_steps < 1:
        raise ValueError(f"frames={frames}, beams={beams}, azimuth_steps={azimuth_steps}: "
                         "each must be at least 1")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", sequence):
        raise ValueError(f"sequence={sequence!r}: give a folder name such as '00' "
                         "(letters, digits, '_' or '-')")


def make_lidar_scans(root: str | Path, frames: int = 6, seed: int = 0, beams: int = 48,
                     azimuth_steps: int = 1800, sequence: str = "00") -> Path:
    """Write ``frames`` scans as ``root/sequences/<sequence>/{velodyne,labels}/NNNNNN.*`` and
    ``root/semantic-demo.yaml``; returns ``root``.

    The sequence folder must be new or empty; other sequences already under ``root`` stay
    (the yaml is the same for all). The same arguments give the same bytes.
    """
    _check(frames, beams, azimuth_steps, sequence)
    root = Path(root)
    folder = fresh_out_dir(root / "sequences" / sequence)
    (folder / "velodyne").mkdir()
    (folder / "labels").mkdir()
    total = 0
    for frame in range(frames):
        rng = np.random.default_rng([seed, frame, zlib.crc32(sequence.encode())])
        points, labels = scan_frame(rng, beams, azimuth_steps)
        points.astype("<f4").tofile(folder / "velodyne" / f"{frame:06d}.bin")
        labels.astype("<u4").tofile(folder / "labels" / f"{frame:06d}.label")
        total += len(points)
    (root / CONFIG).write_text(config_yaml())
    log.info("wrote %d LiDAR scans (%d points) into %s", frames, total, folder)
    return root
