"""An augmented image loader that dies mid-epoch, for the resume test: iterates the loader
test_loader_ops.killed_loader builds, writes each batch's digest and the state after it (one
JSON line, flushed and fsynced before the next batch), and SIGKILLs itself after batch
`kill_after`. Nothing unwinds; what is on disk is what a kill leaves there.

    python tests/loader_killed.py SHARDS READER BACKEND KILL_AFTER OUT.jsonl [OPTIONS_JSON]

OPTIONS_JSON: further loader options (a subset, say), as test_subset.py passes them.
"""
import json
import os
import signal
import sys

from test_loader_ops import batch_digest, killed_loader

shards, reader, backend, kill_after, out = sys.argv[1:6]
extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
with open(out, "w") as f, killed_loader(shards, reader, backend, **extra) as loader:
    for n, batch in enumerate(loader, 1):
        f.write(json.dumps({"digest": batch_digest(batch), "state": loader.state_dict()}) + "\n")
        f.flush()
        os.fsync(f.fileno())
        if n == int(kill_after):
            os.kill(os.getpid(), signal.SIGKILL)
raise SystemExit("the epoch ended before the loader was killed")
