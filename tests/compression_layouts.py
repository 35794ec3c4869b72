"""Gradient compression's state by parameter name, whatever DDP's buckets (for
test_grad_compression.py): one gloo process, a model wrapped twice with other bucket sizes
(so other layouts); the state saved from the first loads into the second with every
parameter's residual where it was. Prints a JSON line of what it checked.

    python tests/compression_layouts.py MODE
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardflow.trainers.compression import Compression

mode = sys.argv[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29561"))
dist.init_process_group("gloo", rank=0, world_size=1)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 200), torch.nn.ReLU(),
                               torch.nn.Linear(200, 10))


def wrapped(cap_mb: float) -> tuple[DistributedDataParallel, Compression]:
    net = model()
    ddp = DistributedDataParallel(net, bucket_cap_mb=cap_mb)
    comp = Compression(mode, net)
    comp.register(ddp)
    return ddp, comp


def steps(ddp: DistributedDataParallel, n: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        ddp.zero_grad()
        ddp(torch.randn(16, 64, generator=gen)).pow(2).mean().backward()


big, comp = wrapped(25.0)
steps(big, 4)
saved = comp.state_dict()
small, other = wrapped(0.05)  # a bucket a layer or so: another layout
other.load_state_dict(saved)
loaded = all(torch.equal(other._residual[k], v) for k, v in saved["residual"].items())
steps(small, 3)  # in the other layout, from the saved residuals
again = other.state_dict()
print(json.dumps({
    "params": {k: p.numel() for k, p in model().named_parameters()},
    "sizes": {k: v.numel() for k, v in saved["residual"].items()},
    "nonzero": sorted(k for k, v in saved["residual"].items() if v.abs().sum() > 0),
    "loaded_equal": loaded, "after": sorted(again["residual"]),
    "buckets": [len(comp._bucket_names) if mode != "int8" else len(comp._chunks),
                len(other._bucket_names) if mode != "int8" else len(other._chunks)]}))
dist.destroy_process_group()
