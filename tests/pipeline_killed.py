"""An image + caption + JSON pipeline that dies mid-epoch, for test_pipelines' resume test:
iterates the pipeline `build` makes, writes each batch's digest and the state after it (one
JSON line, flushed and fsynced before the next batch), and SIGKILLs itself after batch
`kill_after`. Nothing unwinds; what is on disk is what a kill leaves there.

    python tests/pipeline_killed.py SHARDS BACKEND KILL_AFTER OUT.jsonl
"""
import hashlib
import json
import os
import signal
import sys
from typing import Any


def build(shards: str, backend: str) -> Any:
    """The pipeline both processes build: image (crop, flip, an affine), tokens, JSON."""
    import shardflow as sf

    return (sf.Pipeline(shards, seed=7, on_error="skip", backend=backend, shuffle_buffer=10,
                        prefetch=2)
            .fields(jpg=sf.fields.Image(size=24, train=True, augment=[sf.ops.Affine(20)]),
                    txt=sf.fields.Tokens("bytes", length=40), json=sf.fields.Json())
            .batch(8).to("cpu"))


def digest(batch: Any) -> str:
    """Every byte of the batch: pixels, tokens, JSON, keys."""
    h = hashlib.sha256()
    for tensor in (batch["jpg"], batch["txt"]):
        h.update(tensor.contiguous().numpy().tobytes())
    h.update(json.dumps([batch["json"], batch.keys]).encode())
    return h.hexdigest()


if __name__ == "__main__":
    shards, backend, kill_after, out = sys.argv[1:5]
    with open(out, "w") as f, build(shards, backend).loader() as loader:
        for n, batch in enumerate(loader, 1):
            f.write(json.dumps({"digest": digest(batch), "state": loader.state_dict()}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            if n == int(kill_after):
                os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit("the epoch ended before the pipeline was killed")
