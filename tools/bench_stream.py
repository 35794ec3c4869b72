#!/usr/bin/env python3
"""The streaming reader against an S3 server: moto's, started on 127.0.0.1 for the run (the dev
extra), holding the built-in photo-like corpus as shards.

    shardflow bench-stream [--images 400] [--shard-size 2MB] [--repeats 3] [--json X]

Figures, each the median of alternating repeats: a reader epoch (encoded batches: fetching and
tar parsing, no decoding) with 1 and with 4 shards in flight; the first and the second epoch
through a local shard cache (the second reads nothing remote); and the remote bytes a resume
at half the epoch fetches, against a whole epoch's. The server runs on this machine, with no
network latency: what shards in flight buy over a real network (round trips overlapped) shows
here only as overlapped parsing and serving.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from shardflow.builtin import make_photo_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.loading import readers
from shardflow.loading.deferred import resolved
from shardflow.loading.reader_stream import StreamOptions
from shardflow.loading.readplan import plan_epoch
from shardflow.loading.shardcache import ShardCache
from shardflow.loading.shardlist import Source, resolve_source
from shardflow.samples.checks import IMAGE_EXTS
from shardflow.tools.util import parse_size, positive_int, setup_logging

KEY, SECRET = "bench", "bench-secret"


def start_s3() -> tuple[Any, dict[str, Any]]:
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY,
                 aws_secret_access_key=SECRET, region_name="us-east-1"
                 ).create_bucket(Bucket="bench")
    return server, {"key": KEY, "secret": SECRET,
                    "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def epoch(source: Source, stream: StreamOptions, state: dict[str, Any] | None = None,
          stop_after: int | None = None) -> tuple[float, dict[str, Any] | None]:
    """Seconds for the reader's epoch (from `state`), and the state after `stop_after`
    batches when given."""
    plan = plan_epoch(source, epoch=0, seed=0, rank=0, world_size=1, shuffle=True,
                      batch_size=32, shuffle_buffer=256)
    start, saved = time.perf_counter(), None
    batches = readers.encoded("stream", plan, state, "raise", IMAGE_EXTS, stream=stream)
    for n, enc in enumerate(batches, 1):
        if n == stop_after:
            saved = resolved(enc.state)  # plain data, as a loader's state_dict gives
            break
    getattr(batches, "close", lambda: None)()
    return time.perf_counter() - start, saved


def measure(source: Source, repeats: int, scratch: Path) -> dict[str, Any]:
    times: dict[str, list[float]] = {"in_flight_1": [], "in_flight_4": [], "cache_first": [],
                                     "cache_second": []}
    remote: dict[str, int] = {}
    for r in range(repeats):
        for k in (1, 4):
            times[f"in_flight_{k}"].append(epoch(source, StreamOptions(in_flight=k))[0])
        cache = StreamOptions(cache=ShardCache(scratch / f"cache{r}", 1 << 34))
        times["cache_first"].append(epoch(source, cache)[0])
        remote["cache_first"] = cache.stats.remote_bytes
        times["cache_second"].append(epoch(source, cache)[0])
        remote["cache_second"] = cache.stats.remote_bytes - remote["cache_first"]
    whole = StreamOptions()
    batches = sum(1 for _ in readers.encoded(
        "stream", plan_epoch(source, epoch=0, seed=0, rank=0, world_size=1, shuffle=True,
                             batch_size=32, shuffle_buffer=256), None, "raise", IMAGE_EXTS,
        stream=whole))
    _, state = epoch(source, StreamOptions(), stop_after=batches // 2)
    resumed = StreamOptions()
    epoch(source, resumed, state)
    return {"seconds": {k: statistics.median(v) for k, v in times.items()},
            "remote_bytes": {**remote, "epoch": whole.stats.remote_bytes,
                             "resume_at_half": resumed.stats.remote_bytes}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=positive_int, default=400)
    p.add_argument("--shard-size", type=parse_size, default=parse_size("2MB"))
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    setup_logging(True)
    server, options = start_s3()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            src = make_photo_corpus(Path(tmp) / "photos", count=args.images)
            convert(ConvertConfig(kind="imagefolder", src=str(src), out="s3://bench/photos",
                                  max_size=args.shard_size, shuffle_seed=0, workers=2,
                                  storage_options=options))
            source = resolve_source("s3://bench/photos", storage_options=options)
            result = {"shards": len(source.shards), "images": args.images,
                      **measure(source, args.repeats, Path(tmp))}
    finally:
        server.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    raise SystemExit(main(argv))


if __name__ == "__main__":
    entry()
