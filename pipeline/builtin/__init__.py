"""Deterministic generators of the small built-in datasets (numpy and Pillow only, no downloads).

- ``make_image_folder``: ten learnable shape/texture classes, ImageNet folder layout;
- ``make_photo_corpus``: photo-like JPEGs with ImageNet's size statistics, for benchmarks;
  ``make_large_photos``: the same at 3000-4000 px, about 1 MB each (today's photos);
- ``make_text_corpus``: grammar-generated UTF-8 documents for language-model tests;
- ``make_pointcloud_folder``: surface samples of geometric primitives, ``.npy`` and ``.xyz``;
- ``make_lidar_scans``: ray-cast street scenes as SemanticKITTI LiDAR scans, labels and yaml
  (it needs only the sequence folder new or empty, so sequences can share a root);
- ``make_ctr_dataset``: Criteo-style click logs (TSV) with a planted signal and its achievable
  AUC in ``planted.json``.

Each writes into an empty or new folder, returns it as a Path, and gives byte-identical files
for the same arguments: every item draws from ``numpy.random.default_rng([seed, ...item])``.
"""

from .ctr import make_ctr_dataset
from .images import make_image_folder
from .lidar import make_lidar_scans
from .photos import make_large_photos, make_photo_corpus
from .pointclouds import make_pointcloud_folder
from .text import make_text_corpus

__all__ = ["make_ctr_dataset", "make_image_folder", "make_large_photos", "make_lidar_scans",
           "make_photo_corpus", "make_pointcloud_folder", "make_text_corpus"]
