"""The LiDAR segmentation task's networks (trainers/segment_task.py): a logit per class for
every point of ragged scenes, frames concatenated (`ScanBatch`).

    PointNetSeg(points (P, 3), offsets (B + 1,)) -> (P, K)
        points / (50, 50, 3) m -> per-point MLP (local) -> wider MLP -> max over the frame's points
        [local, its frame's max] -> per-point head -> logits
    BevUNet(voxel_coords (V, 4), voxel_counts (V,), frames B, grid (X, Y, Z)) -> (V, K)
        occupied voxels -> dense bird's-eye view (B, Z*2, X, Y): occupancy and log(1 + points)
        of every height cell as channels -> 2D U-Net (two halvings, skips) -> (B, K*Z, X, Y)
        -> (B, K, Z, X, Y) -> the occupied voxels' rows; a point takes its voxel's (the task)

Neither uses batch statistics (LayerNorm per point, GroupNorm per frame), so a batch of one
frame trains as well as a large one, and a frame's logits never depend on the other frames
of its batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn

# metres per unit of the network's input (x, y, z): LiDAR scenes span about +-50 m across
# and a few metres in height about the sensor, so inputs about unit-sized both ways (one
# scale of 50 m leaves heights, what tells ground from objects, too small to learn from)
SCALE_M = (50.0, 50.0, 3.0)
BEV_FEATURES = 2  # per height cell: occupied (1/0), log(1 + points in the voxel)


class PointNetSeg(nn.Module):
    """PointNet's segmentation network on ragged frames: every point's local feature, joined
    to the max over its frame's points of a wider one (the frame's global feature). Linear
    layers on (P, C), so frames of any sizes share one batch without padding; invariant to
    the order of a frame's points."""

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.local = nn.Sequential(_mlp(3, width), _mlp(width, 2 * width))
        self.wide = nn.Sequential(_mlp(2 * width, 4 * width), _mlp(4 * width, 8 * width))
        self.head = nn.Sequential(_mlp(10 * width, 4 * width), _mlp(4 * width, 2 * width),
                                  nn.Linear(2 * width, num_classes))
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.tensor(SCALE_M), persistent=False)

    def forward(self, points: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        local = self.local(points / self.scale)
        wide = self.wide(local)
        frame = frame_index(offsets, len(points))
        pooled = frame_max(wide, frame, len(offsets) - 1)
        return self.head(torch.cat([local, pooled[frame]], dim=1))


def _mlp(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Linear(cin, cout), nn.LayerNorm(cout), nn.ReLU(inplace=True))


def frame_index(offsets: torch.Tensor, points: int) -> torch.Tensor:
    """Each point's frame (P,) from `offsets` (B + 1,). `output_size` spares the host sync
    that repeat_interleave would otherwise make to size its output."""
    frames = torch.arange(len(offsets) - 1, device=offsets.device)
    return torch.repeat_interleave(frames, offsets.diff(), output_size=points)


def frame_max(features: torch.Tensor, frame: torch.Tensor, frames: int) -> torch.Tensor:
    """The max over each frame's points of `features` (P, C) -> (B, C); 0 for a frame
    without points (features are ReLU outputs, so 0 is their floor)."""
    out = features.new_zeros(frames, features.shape[1])
    index = frame[:, None].expand_as(features)
    return out.scatter_reduce(0, index, features, "amax", include_self=False)


class BevUNet(nn.Module):
    """Pillars plus a 2D U-Net: the voxel grid seen from above, its height cells as
    channels, two halvings with skip connections, and K logits per height cell out. The grid's
    X and Y are padded to multiples of 4 (two halvings) and cropped back; Z is fixed by
    `height_cells`."""

    def __init__(self, num_classes: int, height_cells: int, width: int = 32) -> None:
        super().__init__()
        self.num_classes, self.height_cells = num_classes, height_cells
        self.enc1 = _convs(height_cells * BEV_FEATURES, width)
        self.enc2 = _convs(width, 2 * width)
        self.middle = _convs(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = _convs(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = _convs(2 * width, width)
        self.out = nn.Conv2d(width, num_classes * height_cells, 1)

    def forward(self, voxel_coords: torch.Tensor, voxel_counts: torch.Tensor, frames: int,
                grid: tuple[int, int, int]) -> torch.Tensor:
        """The logits (V, K) of each occupied voxel, rows as in `voxel_coords`."""
        x_cells, y_cells, z_cells = grid
        dense = bev_input(voxel_coords, voxel_counts, frames, grid)
        dense = F.pad(dense, (0, -y_cells % 4, 0, -x_cells % 4))
        e1 = self.enc1(dense)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        middle = self.middle(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(middle), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        logits = self.out(d1)[:, :, :x_cells, :y_cells]
        logits = logits.reshape(frames, self.num_classes, z_cells, x_cells, y_cells)
        frame, ix, iy, iz = voxel_coords.unbind(1)
        return logits[frame, :, iz, ix, iy]  # indices around a slice: (V, K)


def _convs(cin: int, cout: int) -> nn.Module:
    def norm() -> nn.Module:
        return nn.GroupNorm(math.gcd(8, cout), cout)

    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), norm(),
                         nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                         norm(), nn.ReLU(inplace=True))


def bev_input(voxel_coords: torch.Tensor, voxel_counts: torch.Tensor, frames: int,
              grid: tuple[int, int, int]) -> torch.Tensor:
    """The dense bird's-eye view (B, Z * 2, X, Y) of the occupied voxels: channel 2z is
    whether cell z of a column is occupied, 2z + 1 the log of 1 + its points."""
    x_cells, y_cells, z_cells = grid
    features = torch.stack([torch.ones_like(voxel_counts, dtype=torch.float32),
                            torch.log1p(voxel_counts.float())], dim=1)
    dense = features.new_zeros(frames, x_cells, y_cells, z_cells, BEV_FEATURES)
    frame, ix, iy, iz = voxel_coords.unbind(1)
    dense[frame, ix, iy, iz] = features  # one row per voxel: no two write one cell
    return dense.permute(0, 3, 4, 1, 2).reshape(frames, z_cells * BEV_FEATURES, x_cells,
                                                 y_cells)
