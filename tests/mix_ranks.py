"""A packed-text mixture per sample on the ranks torchrun starts (gloo), for test_mix.py:
gathers a whole state after batch AT, then runs on through the mixture's second epoch (past its
sources' epoch ends, where the ranks vote); a fresh mixture on the same ranks loads the state
and must give the same rows. Writes OUT/rank<r>.json: the state and both runs' rows.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/mix_ranks.py \
        SHARDS_X SHARDS_Y AT OUT
"""
import json
import sys
from pathlib import Path

import torch.distributed as dist

from shardflow import text_loader

x, y, at, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
dist.init_process_group("gloo")


def make():  # type: ignore[no-untyped-def]
    return text_loader([(x, 0.7), (y, 0.3)], batch_size=4, seq_len=32, device="cpu",
                       use_tuning=False, epoch_batches=10, seed=9)


def rows(batches):  # type: ignore[no-untyped-def]
    return [batch.input_ids.tolist() for batch in batches]


with make() as mixed:
    it = iter(mixed)
    first = rows(next(it) for _ in range(at))
    state = mixed.state_dict()  # every rank calls it: it gathers
    rest = rows(it) + rows(mixed)
    counts = mixed.last_counts
with make() as resumed:
    resumed.load_state_dict(json.loads(json.dumps(state)))
    again = rows(resumed) + rows(resumed)
rank = dist.get_rank()
(out / f"rank{rank}.json").write_text(json.dumps(
    {"state": state, "first": first, "rest": rest, "again": again, "counts": counts}))
dist.destroy_process_group()
