#!/usr/bin/env python3
"""The GPU checks of shardflow, as one script that writes a JSON report part by part.

On a GPU machine where shardflow is installed: `shardflow gpu-check --json OUT/gpu.json`. On
one where nothing installs (torch only), from the repository root, through the package's links
into the checkout (tools/checkout.py):

    python3 tools/checkout.py build/checkout
    PYTHONPATH=$PWD/build/checkout python3 -m shardflow gpu-check --json OUT/gpu.json

On a machine without CUDA, the same orchestration at tiny sizes on the CPU (what the tests run):

    shardflow gpu-check --dry-run --json /tmp/gc.json [--only delivery,copies]
        [--timeout-scale 0.5] [--timeout copies=120] [--budget 600] [--amp-batch 128] [--list]
    shardflow gpu-check --stand-in [--stand-in-s 0.5] [--stand-in-fail ddp] --json ...

Each part runs in its own subprocess (`--part NAME --json-part FILE`) under its own timeout
(`--timeout-scale F` scales them all, `--timeout NAME=S` sets one), and the whole run under a
budget (`--budget S`, default 375 s, the header and every part's start-up included): a part
never gets more than what is left, and one that cannot start in what is left (10 s times
--timeout-scale, or its own timeout if smaller) is recorded as skipped for the budget. The
report is rewritten atomically (temp file, fsync, os.replace) after the header and after every
part, so a kill loses at most the running part, and a part that times out or raises is
recorded ("timeout" / "error", with the tail of its stderr) while the others go on. Every run
starts from a fresh report and work folder (in the temp dir, wiped at the start and the end),
and a part's process ends itself when the orchestrating one is killed. Report: {"header":
{...}, "parts": {name: {"status": ok|failed|error|timeout|skipped|pending, "seconds",
"timeout_s", "key": {key figures}, ...}}, "budget_s", "elapsed_s", "finished": bool}. The
parts, most valuable first, and their default timeouts (350 s in all, plus 20 s for the header:
370 s, within the budget) are tools/bench/gpu's PARTS: described at the end of --help, listed
by --list.

Without CUDA (and without --dry-run) it says whether torch is a CPU-only build or a CUDA build
that sees no GPU, writes the header and exits 0. With --dry-run every part runs its CPU
equivalent at tiny sizes, through the same code (fp16 and bf16, which need CUDA or are emulated
on most CPUs, become fp32; NCCL becomes gloo); --stand-in replaces the header and each part by
a sleep (or a raise), to test the orchestration alone. Exit status: 1 when any part did not
pass (failed, error or timeout; "skipped" passes, for the budget too: with the default timeouts
only a part that overran, itself a failure, or a smaller --budget leaves too little for the
last ones), else 0. A markdown table of the key figures is printed at the end; diagnostics go
to stderr (logging), each part's into its work folder.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import shardflow.tools.bench.gpu as gpu
from shardflow.tools.bench.gpu import BUDGET_S, HEADER_TIMEOUT_S, MIN_START_S, PARTS

log = logging.getLogger("gpu_check")
PASSING = ("ok", "skipped")


# -- the report file -----------------------------------------------------------------------------

def clean(obj: Any) -> Any:
    """JSON-safe: non-finite floats as strings, tuples as lists, other objects as str."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def write_json(path: Path, data: Any) -> None:
    """Write `data` to `path` atomically: a temp file beside it, fsync, os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(clean(data), indent=1, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- running one part in this process --------------------------------------------------------------

def watch_parent(parent_pid: int) -> None:
    """End this part's process when the orchestrating one is gone (killed): a rerun must not
    share the machine with orphans of the last run."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(70)

    threading.Thread(target=watch, name="gpu-check-parent-watch", daemon=True).start()


def stand_in(name: str, seconds: float, fail: list[str]) -> dict[str, Any]:
    """--stand-in: a part as the orchestration sees it, without the work (no torch import):
    it takes `seconds`, and raises when --stand-in-fail names it. The header's is immediate."""
    if name == "header":
        return {"stand_in": True, "cuda_available": None, "dali_imports": None}
    log.info("stand-in for %s: %.2f s", name, seconds)
    time.sleep(seconds)
    if name in fail:
        raise RuntimeError(f"stand-in for {name} failing, as --stand-in-fail asked")
    return {"stand_in": True, "key": {"stand_in": True}}


def run_part_here(args: argparse.Namespace) -> int:
    """`--part NAME`: run one part in this process and write its result to --json-part."""
    if args.parent_pid:
        watch_parent(args.parent_pid)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stand_in:
        result = stand_in(args.part, args.stand_in_s, args.stand_in_fail or [])
    else:
        ctx = gpu.new_ctx(args.dry_run, args.work, args.amp_batch)
        if args.part != "header" and not ctx.cuda and not args.dry_run:
            raise SystemExit("no CUDA here: run the parts with --dry-run")
        log.info("part %s on %s (dry run: %s)", args.part, ctx.device, ctx.dry)
        result = gpu.run_part(args.part, ctx)
    write_json(args.json_part, result)
    return 0


# -- orchestration -------------------------------------------------------------------------------

def stderr_tail(path: Path, lines: int = 25, chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """The part's process and anything it started (its own session): by process-group id."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def part_command(name: str, args: argparse.Namespace, folder: Path) -> list[str]:
    cmd = [sys.executable, "-m", "shardflow.tools.gpu_check", "--part", name,
           "--json-part", str(folder / "result.json"), "--work", str(folder / "work"),
           "--parent-pid", str(os.getpid())]
    if args.dry_run:
        cmd.append("--dry-run")
    if args.amp_batch:
        cmd += ["--amp-batch", str(args.amp_batch)]
    if args.stand_in:
        cmd += ["--stand-in", "--stand-in-s", str(args.stand_in_s)]
    if args.stand_in_fail:
        cmd += ["--stand-in-fail", ",".join(args.stand_in_fail)]
    return cmd


def run_part_process(name: str, args: argparse.Namespace, work: Path,
                     timeout: float) -> dict[str, Any]:
    """Run one part in a subprocess under `timeout`; its result, or why there is none."""
    folder = work / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    err_path = folder / "stderr.log"
    start = time.perf_counter()
    with open(folder / "stdout.log", "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(part_command(name, args, folder), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                kill_group(proc)
    seconds = round(time.perf_counter() - start, 1)
    if code is None:
        tail = stderr_tail(err_path)
        result = {"status": "timeout", "error": f"still running after {timeout:.1f} s, killed"
                                                + (f"; its stderr ended with:\n{tail}" if tail
                                                   else "")}
    elif code != 0 or not (folder / "result.json").exists():
        result = {"status": "error", "error": f"exit code {code}:\n{stderr_tail(err_path)}"}
    else:
        result = json.loads((folder / "result.json").read_text())
        result.setdefault("status", "ok")
    return {**result, "seconds": seconds, "timeout_s": timeout}


def work_root(json_path: Path) -> Path:
    """One work folder per report path, outside the report's folder (so a kill leaves no bulk
    beside the report) and wiped at the start of every run."""
    digest = hashlib.sha1(str(json_path.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"gpu_check-{digest}"


def fresh_start(json_path: Path) -> Path:
    """Forget any earlier run: its work folder and half-written temp reports."""
    work = work_root(json_path)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    for stale in json_path.parent.glob(f".{json_path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    return work


def timeouts(args: argparse.Namespace, names: list[str]) -> dict[str, float]:
    """Per part: --timeout NAME=S if given, else the default times --timeout-scale."""
    return {n: args.timeout.get(n, PARTS[n].timeout_s * args.timeout_scale) for n in names}


class Budget:
    """The whole run's wall-clock limit (--budget), counted from `start` (time.monotonic)."""

    def __init__(self, seconds: float, start: float, min_start: float) -> None:
        self.seconds, self.start, self.min_start = seconds, start, min_start

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def limit(self, timeout: float) -> float | None:
        """The time a part of `timeout` gets: its timeout, or what is left if less; None when
        what is left is under what a part needs to start (min_start, or its timeout if
        smaller)."""
        left = math.floor(self.left() * 10) / 10  # as the report shows it, never above
        return None if left < min(timeout, self.min_start) else min(timeout, left)

    def skipped(self, timeout: float) -> dict[str, Any]:
        return {"status": "skipped", "budget": True, "seconds": 0.0, "timeout_s": timeout,
                "reason": f"the budget: {max(self.left(), 0.0):.1f} s of --budget "
                          f"{self.seconds:g} s left, too little to start"}


def budgeted(name: str, args: argparse.Namespace, work: Path, timeout: float,
             budget: Budget) -> dict[str, Any]:
    """The part run under `timeout` or what is left of the budget, or skipped for it."""
    limit = budget.limit(timeout)
    if limit is None:
        return budget.skipped(timeout)
    log.info("part %s (timeout %.1f s%s)", name, limit,
             f", cut from {timeout:g} s by the budget" if limit < timeout else "")
    result = run_part_process(name, args, work, limit)
    if limit < timeout:
        result["budget_cut_from_s"] = timeout
        if result["status"] == "timeout":
            result["error"] = f"cut by the budget (--budget {budget.seconds:g} s): " + \
                result["error"]
    return result


def header_message(header: dict[str, Any]) -> str:
    if header.get("stand_in"):
        return "header: a stand-in (--stand-in)"
    if header.get("status") not in (None, "ok"):
        return f"header: {header.get('status')} ({header.get('error', '')[:200]})"
    gpu = header.get("gpu") or header.get("cuda_state")
    dali = header.get("dali_version") if header.get("dali_imports") else "no"
    return (f"GPU: {gpu}; torch {header.get('torch')}, CUDA {header.get('cuda_version')}, "
            f"DALI {dali}, {header.get('cpu_count')} CPUs")


def figures(result: dict[str, Any]) -> str:
    """The table's cell: the reason of a skip, the key figures, the gist of an error."""
    status, pieces = result.get("status"), []
    if status == "skipped":
        pieces.append(str(result.get("reason", "")))
    if "key" in result:
        pieces.append(", ".join(f"{k}={v}" for k, v in result["key"].items()))
    if status in ("error", "timeout"):
        lines = str(result.get("error", "")).strip().splitlines() or [""]
        pieces.append(lines[0] if status == "timeout" else lines[-1])
    return "; ".join(pieces).replace("|", "/")[:200]


def table(report: dict[str, Any]) -> str:
    lines = [header_message(report["header"]), "",
             "| part | status | s | key figures |", "|---|---|---:|---|"]
    for name, result in report["parts"].items():
        lines.append(f"| {name} | {result['status']} | {result.get('seconds', '')} | "
                     f"{figures(result)} |")
    return "\n".join(lines)


def run_parts(args: argparse.Namespace, report: dict[str, Any], work: Path,
              budget: Budget) -> None:
    limits = timeouts(args, list(report["parts"]))
    dali = report["header"].get("dali_imports")
    for name in report["parts"]:
        if PARTS[name].needs_dali and dali is False:
            result = {"status": "skipped", "reason": "nvidia.dali does not import: "
                      f"{report['header'].get('dali_error', '')}", "seconds": 0.0}
        else:
            result = budgeted(name, args, work, limits[name], budget)
        log.info("part %s: %s in %s s", name, result["status"], result["seconds"])
        report["parts"][name] = result
        report["elapsed_s"] = round(time.monotonic() - budget.start, 1)
        write_json(args.json, report)


def orchestrate(args: argparse.Namespace, start: float) -> int:
    """The header, then every part in turn, all within the budget counted from `start`."""
    names = [n for n in PARTS if not args.only or n in args.only]  # most valuable first
    budget = Budget(args.budget, start, MIN_START_S * args.timeout_scale)
    work = fresh_start(args.json)
    limits = timeouts(args, names)
    report: dict[str, Any] = {
        "tool": "shardflow gpu-check", "dry_run": args.dry_run, "finished": False,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "budget_s": args.budget, "header": {"status": "pending"},
        "parts": {n: {"status": "pending", "timeout_s": t} for n, t in limits.items()}}
    write_json(args.json, report)
    log.info("parts: %s", ", ".join(f"{n} ({t:g} s)" for n, t in limits.items()))
    if HEADER_TIMEOUT_S + sum(limits.values()) > args.budget:
        log.warning("the header's and parts' timeouts add up to %g s, over --budget %g s: the "
                    "last parts may be cut short or skipped",
                    HEADER_TIMEOUT_S + sum(limits.values()), args.budget)
    report["header"] = budgeted("header", args, work, HEADER_TIMEOUT_S, budget)
    write_json(args.json, report)
    if not args.dry_run and report["header"].get("cuda_available") is False:
        state = report["header"]["cuda_state"]
        for name in names:
            report["parts"][name] = {"status": "skipped", "reason": f"no CUDA: {state}"}
        report["finished"] = True
        write_json(args.json, report)
        shutil.rmtree(work, ignore_errors=True)
        print(f"no CUDA here: {state}; nothing to check (--dry-run runs the orchestration on "
              f"the CPU). Header written to {args.json}")
        # A CUDA build that sees no GPU is a broken GPU machine (a driver too old for its CUDA,
        # no device passed through): not a pass for a wrapper that reads the status only.
        return NO_GPU_SEEN if report["header"].get("cuda_build") else 0
    run_parts(args, report, work, budget)
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    report["finished"] = True
    write_json(args.json, report)
    shutil.rmtree(work, ignore_errors=True)
    print(table(report))
    return exit_status(report)


NO_GPU_SEEN = 3  # the exit status of a CUDA build of torch that sees no GPU

def exit_status(report: dict[str, Any]) -> int:
    """1 when any part did not pass (failed, error, timeout; a skip is a pass: no DALI, one
    GPU), else 0: a wrapper script or CI sees a broken part without reading the JSON."""
    failing = [n for n, r in report["parts"].items() if r.get("status") not in PASSING]
    if failing:
        log.error("parts that did not pass: %s", ", ".join(failing))
    return 1 if failing else 0


# -- command line --------------------------------------------------------------------------------

def part_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown}; choose from "
                                         f"{', '.join(PARTS)}")
    return names


def part_timeout(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in PARTS:
        raise argparse.ArgumentTypeError(f"unknown part {name!r}; choose from {', '.join(PARTS)}")
    try:
        return name, float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=SECONDS") from None


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds above 0")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, epilog=gpu.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=Path("gpu-report.json"), help="the report")
    p.add_argument("--dry-run", action="store_true", help="tiny CPU versions of every part")
    p.add_argument("--only", type=part_names, help="NAME[,NAME]: run only these parts")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="times every part's timeout")
    p.add_argument("--timeout", type=part_timeout, action="append", default=[],
                   metavar="NAME=S", help="one part's timeout in seconds (not scaled)")
    p.add_argument("--budget", type=positive_seconds, default=BUDGET_S, metavar="S",
                   help="the whole run's limit in seconds, header included (default "
                        f"{BUDGET_S:g}): a part gets at most what is left, and is skipped when "
                        f"less than {MIN_START_S:g} s (times --timeout-scale) is left")
    p.add_argument("--amp-batch", type=int, help="amp_step's batch (default 256; dry run 2)")
    p.add_argument("--list", action="store_true",
                   help="list the header's and parts' timeouts, their sum and the budget")
    p.add_argument("--stand-in", action="store_true",
                   help="dry run with a trivial stand-in for the header and each part: "
                        "tests of the orchestration")
    p.add_argument("--stand-in-s", type=float, default=0.2, help="seconds each stand-in takes")
    p.add_argument("--stand-in-fail", type=part_names, help="NAME[,NAME]: stand-ins that raise")
    p.add_argument("--part", choices=["header", *PARTS], help=argparse.SUPPRESS)
    p.add_argument("--json-part", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.timeout = dict(args.timeout)
    args.dry_run = args.dry_run or args.stand_in
    if args.part and not (args.json_part and args.work):
        p.error("--part needs --json-part and --work")
    return args


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()  # the budget counts from here
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s: %(message)s")
    if args.list:
        rows = [("header", HEADER_TIMEOUT_S), *((n, s.timeout_s) for n, s in PARTS.items())]
        print("\n".join(f"{n}\t{t:g} s" for n, t in rows))
        print(f"total\t{sum(t for _, t in rows):g} s\nbudget\t{BUDGET_S:g} s")
        return 0
    if args.part:
        return run_part_here(args)
    return orchestrate(args, start)


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
