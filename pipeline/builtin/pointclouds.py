"""Point clouds of six geometric primitives for point-cloud pipeline tests and tiny training runs.

``make_pointcloud_folder`` samples points uniformly by area on the surface of a sphere, box,
cylinder, cone, torus or square pyramid, then applies a random mild anisotropic scale, a uniformly
random 3D rotation, a small translation and Gaussian jitter. Each cloud is a float32 array of
shape (points, 3) in ``out/<class>/<class>_<i:05d>.npy``; every 25th is written as ASCII
``.xyz`` instead ("x y z" per line) so that readers exercise both formats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .images import fresh_out_dir

log = logging.getLogger(__name__)

XYZ_EVERY = 25
NOISE_STD = 0.01

# A sampler returns n surface points of one primitive with extent about 1, centred near 0.
Sampler = Callable[[np.random.Generator, int], np.ndarray]


def _disk(rng: np.random.Generator, n: int, radius: float) -> np.ndarray:
    # sqrt makes the density uniform in area rather than in radius.
    r = radius * np.sqrt(rng.random(n))
    theta = rng.uniform(0, 2 * np.pi, n)
    return np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1)


def _split(rng: np.random.Generator, n: int, areas: list[float]) -> np.ndarray:
    """Assign each of n points to a surface part with probability proportional to its area."""
    weights = np.asarray(areas, dtype=np.float64)
    return rng.choice(len(areas), size=n, p=weights / weights.sum())


def _triangles(rng: np.random.Generator, n: int, corners: np.ndarray) -> np.ndarray:
    """Sample n points uniformly over the triangles ``corners`` (T x 3 x 3) by area."""
    edges_a, edges_b = corners[:, 1] - corners[:, 0], corners[:, 2] - corners[:, 0]
    areas = 0.5 * np.linalg.norm(np.cross(edges_a, edges_b), axis=1)
    which = _split(rng, n, list(areas))
    u, v = rng.random((2, n, 1))
    # Reflect points from the far half of the parallelogram back into the triangle.
    flip = (u + v) > 1
    u, v = np.where(flip, 1 - u, u), np.where(flip, 1 - v, v)
    return corners[which, 0] + u * edges_a[which] + v * edges_b[which]


def _sphere(rng: np.random.Generator, n: int) -> np.ndarray:
    points = rng.standard_normal((n, 3))
    return points / np.linalg.norm(points, axis=1, keepdims=True)


def _cube(rng: np.random.Generator, n: int) -> np.ndarray:
    half = rng.uniform(0.6, 0.8, 3)
    points = rng.uniform(-half, half, (n, 3))
    # The face normal to axis k has area proportional to the product of the other two extents.
    axis = _split(rng, n, [half[1] * half[2], half[0] * half[2], half[0] * half[1]])
    sign = rng.choice([-1.0, 1.0], size=n)
    points[np.arange(n), axis] = sign * half[axis]
    return points


def _cylinder(rng: np.random.Generator, n: int) -> np.ndarray:
    radius, half_height = rng.uniform(0.5, 0.7), rng.uniform(0.7, 1.0)
    part = _split(rng, n, [2 * np.pi * radius * 2 * half_height, np.pi * radius**2])
    theta = rng.uniform(0, 2 * np.pi, n)
    points = np.stack([radius * np.cos(theta), radius * np.sin(theta), rng.uniform(-1, 1, n)], 1)
    points[:, 2] *= half_height
    caps = part == 1
    points[caps, :2] = _disk(rng, int(caps.sum()), radius)
    points[caps, 2] = rng.choice([-half_height, half_height], size=int(caps.sum()))
    return points


def _cone(rng: np.random.Generator, n: int) -> np.ndarray:
    radius, height = rng.uniform(0.6, 0.8), rng.uniform(1.3, 1.7)
    lateral = np.pi * radius * np.hypot(radius, height)
    part = _split(rng, n, [lateral, np.pi * radius**2])
    # On the lateral surface the ring at fraction t from the apex has length proportional to t.
    t = np.sqrt(rng.random(n))
    theta = rng.uniform(0, 2 * np.pi, n)
    points = np.stack([t * radius * np.cos(theta), t * radius * np.sin(theta), (1 - t) * height], 1)
    base = part == 1
    points[base, :2] = _disk(rng, int(base.sum()), radius)
    points[base, 2] = 0.0
    points[:, 2] -= height / 4  # the centroid of a solid cone sits a quarter up
    return points


def _torus(rng: np.random.Generator, n: int) -> np.ndarray:
    major, minor = rng.uniform(0.6, 0.75), rng.uniform(0.2, 0.33)
    # The outer side of the tube has more area: accept tube angles with probability
    # (R + r cos phi) / (R + r); loop until enough (rarely more than twice).
    accepted = np.empty(0)
    while accepted.size < n:
        phi = rng.uniform(0, 2 * np.pi, 2 * n)
        keep = rng.random(2 * n) < (major + minor * np.cos(phi)) / (major + minor)
        accepted = np.concatenate([accepted, phi[keep]])
    phi, theta = accepted[:n], rng.uniform(0, 2 * np.pi, n)
    ring = major + minor * np.cos(phi)
    return np.stack([ring * np.cos(theta), ring * np.sin(theta), minor * np.sin(phi)], 1)


def _pyramid(rng: np.random.Generator, n: int) -> np.ndarray:
    half, height = rng.uniform(0.6, 0.8), rng.uniform(1.1, 1.5)
    base = np.array([[-half, -half, 0], [half, -half, 0], [half, half, 0], [-half, half, 0]])
    apex = np.array([0.0, 0.0, height])
    sides = [[base[k], base[(k + 1) % 4], apex] for k in range(4)]
    corners = np.array([*sides, [base[0], base[1], base[2]], [base[0], base[2], base[3]]])
    points = _triangles(rng, n, corners)
    points[:, 2] -= height / 4
    return points


SHAPES: dict[str, Sampler] = {
    "sphere": _sphere,
    "cube": _cube,
    "cylinder": _cylinder,
    "cone": _cone,
    "torus": _torus,
    "pyramid": _pyramid,
}


def _rotation(rng: np.random.Generator) -> np.ndarray:
    # QR of a Gaussian matrix, with signs fixed, is a uniformly random orthogonal matrix; flipping
    # one column when the determinant is -1 keeps it a proper rotation.
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def sample_cloud(shape: str, points: int, rng: np.random.Generator) -> np.ndarray:
    """Return a (points, 3) float32 cloud of ``shape`` (a key of ``SHAPES``), posed at random."""
    cloud = SHAPES[shape](rng, points) * rng.uniform(0.8, 1.2, 3)
    cloud = cloud @ _rotation(rng).T + rng.normal(0.0, 0.05, 3)
    cloud += rng.normal(0.0, NOISE_STD, cloud.shape)
    return cloud.astype(np.float32)


def _save(cloud: np.ndarray, path: Path) -> None:
    if path.suffix == ".xyz":
        np.savetxt(path, cloud, fmt="%.6f", delimiter=" ")
    else:
        np.save(path, cloud, allow_pickle=False)


def make_pointcloud_folder(
    out: str | Path, *, per_class: int = 40, points: int = 1024, seed: int = 0
) -> Path:
    """Write ``per_class`` clouds of ``points`` points for each class in ``SHAPES``.

    Files are ``out/<class>/<class>_<i:05d>.npy``, except every 25th (``i % 25 == 0``), which is
    ``.xyz`` text. The same arguments give byte-identical files.
    """
    out = fresh_out_dir(out)
    for class_index, name in enumerate(SHAPES):
        folder = out / name
        folder.mkdir()
        for i in range(per_class):
            rng = np.random.default_rng([seed, class_index, i])
            suffix = ".xyz" if i % XYZ_EVERY == 0 else ".npy"
            _save(sample_cloud(name, points, rng), folder / f"{name}_{i:05d}{suffix}")
    log.info("wrote %d point clouds in %d classes to %s", per_class * len(SHAPES), len(SHAPES), out)
    return out
