"""Runs a command (the `entry(argv)` of one of shardflow.tools' modules) in a process forked
from this one, which imported the commands' modules once, so that each run skips the seconds
a new Python spends importing torch, DALI and matplotlib. conftest.run_tool starts one per
test process.

One request a line on stdin (JSON: module, argv, script, cwd, env, stdout, stderr, timeout);
one answer a line on stdout: {"code": exit status}, negative for a signal, as subprocess
reports it. The child starts from this process's clean state (nothing a test patched), takes
the test's directory and environment, writes its output to the named files, and is ended by
SIGALRM after `timeout` seconds (code -14).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import traceback

# What the forked commands import on their way (a module that does not import here, such as
# nvidia.dali in the no-DALI pass, is left to the child, which then fails as a process would).
PRELOAD = ("torch", "torch._dynamo", "nvidia.dali", "matplotlib.figure",
           "matplotlib.backends.backend_agg", "shardflow.tools.train",
           "shardflow.tools.make_shards", "shardflow.tools.verify_shards",
           "shardflow.tools.plot_run", "shardflow.tools.show_shards",
           "shardflow.image.loader", "shardflow.text.loader", "shardflow.pointcloud.loader",
           "shardflow.tabular.loader", "shardflow.trainers.run")


def run_child(request: dict) -> None:
    """In the forked child: become the command's process, run it, exit with its status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        os.dup2(os.open(path, flags), fd)
    sys.argv = [request["script"], *request["argv"]]
    signal.alarm(max(1, int(request["timeout"])))
    code = 0
    try:
        importlib.import_module(request["module"]).entry(request["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter does: a traceback and status 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
