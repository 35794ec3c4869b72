"""Loader states that do not depend on the rank that saved them, and resuming them on another
number of ranks.

    state = loader.state_dict()     # under torch.distributed: on every rank (it gathers)
    loader.load_state_dict(state)   # on any rank, at any world size

A whole state holds the loader's settings and every rank's progress ("ranks": epoch, batches,
the reader's position, skips so far). At the world size it was saved at, each rank continues
from its own entry, exactly as if it had not stopped. At another, the rest of the epoch is
every sample of it that no rank has read (consumed.py records them by shard and key); the new
ranks split it as they would split an epoch (readplan.plan_rest), each sample read once; the
next epoch is whole again. The skips so far go to the new rank 0, so that each is counted once.

What "the rest" means: the samples the old ranks had not read. Those the old plan would have
left out at the epoch's end to even out its ranks are part of it; the new plan evens out the
rest over the new ranks, and reports what it leaves out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardflow.loading import consumed

RANK_FIELDS = ("epoch", "batches", "reader_state", "skipped", "rest", "filtered")


def gather(local: dict[str, Any], world_size: int) -> list[dict[str, Any]] | None:
    """Every rank's `local` state, in rank order, through torch.distributed; None when it is
    not initialised with this world size (then each rank's state stays its own)."""
    if world_size == 1:
        return [local]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) \
            or dist.get_world_size() != world_size:
        return None
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, local)
    return out


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One whole state from every rank's own (`state_dict(gather=False)` on each rank, in any
    order): what `state_dict()` gathers under torch.distributed."""
    if not states:
        raise ValueError("merge_states: no states")
    if "ranks" in states[0]:
        return states[0]
    world = int(states[0]["world_size"])
    by_rank = {int(s["rank"]): s for s in states}
    if sorted(by_rank) != list(range(world)) or len(states) != world:
        raise ValueError(f"merge_states needs one state of each of ranks 0..{world - 1}; got "
                         f"ranks {sorted(int(s['rank']) for s in states)}")
    common = {k: v for k, v in states[0].items() if k not in RANK_FIELDS and k != "rank"}
    for s in states[1:]:
        for k, v in common.items():
            if k not in ("source",) and s.get(k) != v:
                raise ValueError(f"merge_states: ranks differ in {k}: {s.get(k)!r} against "
                                 f"{v!r}")
    ranks = [{k: by_rank[r].get(k) for k in RANK_FIELDS} for r in range(world)]
    # Ranks step together: the first one's position names the whole state's.
    return {**common, "epoch": ranks[0]["epoch"], "batches": ranks[0]["batches"],
            "ranks": ranks}


def rest_of_epoch(ranks: list[dict[str, Any]], finished: Callable[[dict[str, Any]], bool],
                  consumed_of: Callable[[dict[str, Any]], list[consumed.Snapshot | None]]
                  ) -> tuple[int, dict[str, Any] | None]:
    """(epoch to continue, the rest of it, or None to start it whole) from the saved ranks'
    entries. `finished(entry)`: whether that rank had read its whole epoch; `consumed_of`:
    the snapshots of what a rank's entry says was read."""
    epochs = {int(e["epoch"]) + finished(e) for e in ranks}
    if len(epochs) != 1:
        raise ValueError(f"loader state: the saved ranks are in different epochs "
                         f"({sorted(epochs)}), which a run stepping its ranks together does "
                         "not save; resume it on the world size it was saved at")
    epoch = epochs.pop()
    snaps: list[consumed.Snapshot | None] = []
    for entry in ranks:
        if int(entry["epoch"]) != epoch:
            continue  # that rank had finished the epoch before: nothing of this one is read
        rest = entry.get("rest")
        if rest:
            snaps.append(rest["consumed"])
        snaps.extend(consumed_of(entry))
    if not any(snaps):
        return epoch, None
    if any(entry.get("reader_state") and not _tracked(consumed_of(entry)) for entry in ranks
           if int(entry["epoch"]) == epoch):
        raise ValueError("loader state does not say which samples were read (shards without "
                         "sample counts, or saved by an older shardflow); resume it on the "
                         "world size it was saved at")
    done, partial = consumed.union(snaps)
    snapshot = {"done": sorted(done),
                "partial": [[i, sorted(keys)] for i, keys in sorted(partial.items())]}
    return epoch, {"epoch": epoch, "consumed": snapshot}


def _tracked(snaps: list[consumed.Snapshot | None]) -> bool:
    return all(s is not None for s in snaps)


def skips_for(rank: int, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The skips a new rank takes over: all of them on rank 0, none elsewhere."""
    if rank != 0:
        return []
    return [entry for r in ranks for entry in (r.get("skipped") or [])]
