"""Point clouds: shards of .npy + .cls -> header checks and per-key parameters -> DALI graph
(decode, normalize, sample, rotate/scale, jitter) -> voxels -> `PointBatch` on the device."""

from shardflow.pointcloud.config import PointCloudConfig
from shardflow.pointcloud.loader import PointCloudLoader, pointcloud_loader

__all__ = ["PointCloudConfig", "PointCloudLoader", "pointcloud_loader"]
