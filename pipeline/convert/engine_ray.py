"""The Ray engine of make_shards (`--engine ray`): the conversion's workers as Ray tasks.

    driver: plan -> ordered task list -> chunks ──Ray tasks (retried when a worker dies)──▶
            checked samples, taken in input order -> the local engine's ShardWriter, journal
            and manifest

Only the work that needs CPUs runs as tasks: reading, checking and repairing inputs
(`job.run_task`). The driver writes every shard in input order, exactly as the local engine
does, so shards, `.idx` files and the manifest are byte for byte the same whichever engine
ran, and a killed run resumes from its journal with either engine. (Running `--part` slices
as tasks and merging them would not give the same bytes: each part cuts its own shards and
names them `train-pNNN-...`.) The price: every sample passes through the driver, whose
network and disk bound the rate; the workers need the source at the same path or URL.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from functools import cache
from itertools import islice
from typing import Any, TypeVar

from shardflow.executor import CHUNK, WorkerError
from shardflow.urls import redact

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

INSTALL = "--engine ray needs Ray: pip install 'shardflow[ray]'"
# A Ray task costs more than a pool submit (scheduling, the object store, RPCs), so a task
# takes several of the local engine's chunks (4 x 8 files, or 4 parquet row chunks).
TASK_CHUNKS = 4
WINDOW_PER_CPU = 2  # tasks in flight per CPU: every CPU busy while the driver writes
# A task whose worker process dies (killed, out of memory, its node lost) runs again this many
# times; an exception raised by the task itself is never retried (a data or code error).
MAX_RETRIES = 3


def connected() -> bool:
    """Whether this process is already connected to Ray; a clear error if Ray is missing."""
    try:
        import ray
    except ImportError:
        raise ValueError(INSTALL) from None
    return bool(ray.is_initialized())


@contextlib.contextmanager
def session(address: str | None, cpus: int) -> Iterator[None]:
    """Ray for one conversion: the cluster at `address` ("auto": the one this machine is part
    of), or a local Ray with `cpus` CPUs; disconnected (a local one stopped) at the end."""
    import ray

    # Ray's own messages at this process's level (make_shards --quiet: errors only)
    level = max(logging.WARNING, logging.getLogger().getEffectiveLevel())
    try:
        if address:
            ray.init(address=address, logging_level=level)
        else:  # "local": never join a cluster named by RAY_ADDRESS without being asked
            ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                     logging_level=level)
    except ConnectionError as err:
        raise ValueError(f"--ray-address {redact(address or '')}: no Ray cluster answered "
                         f"({err}); start one with `ray start --head`, or leave the option "
                         "out to run a local Ray") from None
    log.info("Ray engine: %s CPUs (%s)", ray.cluster_resources().get("CPU"),
             redact(address) if address else "local")
    try:
        yield
    finally:
        ray.shutdown()


def _run_chunk(fn: Callable[[T, Any], R], chunk: list[T], extra: Any) -> list[R]:
    return [fn(item, extra) for item in chunk]


@cache
def _remote_chunk() -> Any:
    import ray

    return ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(_run_chunk)


def ordered_map(fn: Callable[[T, Any], R], items: Iterable[T], extra: Any, workers: int,
                *, chunk: int = CHUNK, window: int | None = None,
                timeout_s: float | None = None, describe: Callable[[T], str] = str
                ) -> Generator[R, None, None]:
    """`executor.ordered_map`'s contract on the connected Ray: `fn(item, extra)` for each item,
    in order, at most `window` tasks in flight (default: WINDOW_PER_CPU per CPU of the
    cluster; `workers` is the local engine's and not used). A task with no result
    `timeout_s` after it became the oldest in flight is hung; a task whose worker died more
    than MAX_RETRIES times is lost: both end the map with a WorkerError naming the task's
    inputs. An exception `fn` raised is raised here. A hung task is cancelled (its worker
    stopped); tasks still running when the map ends early are left to finish, and their
    results dropped: cancelling a task as it finishes can crash this process (a race in
    Ray's core worker, "Tried to complete task that was not pending"), and a finished
    driver's tasks end with it anyway."""
    import ray

    if timeout_s is not None and timeout_s >= threading.TIMEOUT_MAX:
        timeout_s = None  # beyond what a wait can take: no limit
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    window = window or WINDOW_PER_CPU * cpus
    remote, source = _remote_chunk(), iter(items)
    fn_ref, extra_ref = ray.put(fn), ray.put(extra)  # sent to each node once, not per task
    pending: deque[tuple[Any, list[T]]] = deque()
    while True:
        while len(pending) < window and (batch := list(islice(source, chunk * TASK_CHUNKS))):
            pending.append((remote.remote(fn_ref, batch, extra_ref), batch))
        if not pending:
            return
        results = _result(*pending.popleft(), timeout_s, describe)
        yield from results


def _result(ref: Any, batch: list[T], timeout_s: float | None,
            describe: Callable[[T], str]) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError, RayError, RayTaskError

    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        ray.cancel(ref, force=True)  # safe: a hung task cannot be finishing (see ordered_map)
        raise WorkerError(f"no result for {timeout_s:.0f} s from the Ray task on "
                          f"{_names(batch, describe, 3)}: it is hung (a stalled read or "
                          "decode); raise the worker timeout if such inputs legitimately "
                          "take that long") from None
    except RayTaskError as err:
        raise err.cause from err  # what fn raised (after the task's traceback), as locally
    except RayError as err:
        raise WorkerError(f"a Ray worker died (killed, out of memory, or its node lost) on "
                          f"every one of {MAX_RETRIES + 1} tries at the inputs "
                          f"{_names(batch, describe, 40)} ({type(err).__name__})") from None


def _names(items: list[T], describe: Callable[[T], str], limit: int) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(describe(item) for item in items[:limit]) + more
