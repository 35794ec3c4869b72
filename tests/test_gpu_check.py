"""tools/gpu_check.py's orchestration, on the CPU: the dry run records every part and a header,
the report is valid JSON after every part, a part over its timeout (or one that raises) is
recorded and the next one runs, a rerun after a SIGKILL starts afresh and completes, and the
whole run keeps to its budget (--budget: a part gets at most what is left, one that cannot
start is skipped), whose default the default timeouts fit.

Only the first test (and the last) run the real header and parts on the CPU; the others use
--stand-in (a sleep, or a raise, for the header and each part): the same subprocesses, timeouts
and report writes, without importing torch nine times."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, gpu_available, run_tool

TOOL = ROOT / "tools" / "gpu_check.py"
PARTS = ["delivery", "amp_step", "copies", "offload", "ddp", "checkpointing",
         "text_pointcloud", "dali", "sync_debug", "compile", "ranks", "ops", "pipeline"]
NO_CUDA = ("torch here is a CPU-only build", "torch is a CUDA build but no GPU is visible")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def snapshots_while(proc: subprocess.Popen, out: Path, stale: str) -> list[dict]:
    """Every distinct report seen while `proc` runs, once it replaced the `stale` one; each
    must parse (the writes are atomic)."""
    seen: list[dict] = []
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        text = out.read_text()
        if text != stale:
            data = json.loads(text)
            if not seen or data != seen[-1]:
                seen.append(data)
        time.sleep(0.05)
    return seen


def done(report: dict) -> list[str]:
    return [n for n, p in report["parts"].items() if p["status"] != "pending"]


def test_dry_run_records_every_part_and_the_header(tmp_path: Path) -> None:
    """Every part's CPU equivalent, through the same code, run as on the lent GPU machine,
    which installs nothing: tools/checkout.py lays the package out as links into this
    checkout, and the check and each part's subprocess import shardflow there. The timeouts
    and the budget are the GPU machine's (6.25 minutes in all); a dry run on 2 shared cores came
    within 1.5x of some parts' (amp_step, compile, ranks), so it gets twice as long here."""
    tree = tmp_path / "checkout"
    made = subprocess.run([sys.executable, str(ROOT / "tools" / "checkout.py"), str(tree)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # Every subpackage from the tree: here an editable install would fill in one it lacks,
    # which the GPU machine does not have.
    where = subprocess.run([sys.executable, "-c", "import shardflow.loading.loader as a, "
                            "shardflow.trainers.loop as b, shardflow.tools.gpu_check as c; "
                            "print(a.__file__, b.__file__, c.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(Path(p).is_relative_to(tree) for p in where.stdout.split()), where.stdout
    out = tmp_path / "gc.json"
    proc = subprocess.run([sys.executable, "-m", "shardflow", "gpu-check", "--dry-run",
                           "--timeout-scale", "2", "--budget", "720", "--json", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = load(out)
    assert report["finished"] and report["dry_run"]
    header = report["header"]
    assert header["status"] == "ok" and header["shardflow"] == str(tree / "shardflow")
    assert header["cuda_build"] == (header["cuda_version"] is not None)
    assert {"torch", "cpu_count", "dali_imports", "gpu", "cuda_available"} <= set(header)
    if not gpu_available():
        assert header["cuda_available"] is False and header["cuda_state"] in NO_CUDA
    assert list(report["parts"]) == PARTS
    for name, part in report["parts"].items():
        assert part["status"] in ("ok", "skipped"), (name, part)
        assert part["seconds"] <= part["timeout_s"]
    delivery = report["parts"]["delivery"]
    assert delivery["key"]["mismatches"] == 0 and delivery["key"]["batches"] > 0
    if not header["dali_imports"]:
        assert report["parts"]["dali"]["status"] == "skipped"
    else:
        dali = report["parts"]["dali"]
        assert set(dali["stage_seconds"]) >= {"corpus_and_conversion", "large_photos"}
        assert dali["key"]["large_portable"] > 0 and dali["key"]["large_dali_cpu_decode"] > 0
        agreement = dali["agreement"]  # on the CPU: torch's resize against the graph's
        assert agreement["keys_and_labels_equal"] and agreement["batches"] == 2
        assert 0 < agreement["mean_abs_pixel_diff"] < 3
    scenes = report["parts"]["text_pointcloud"]["scenes"]
    assert scenes["batches_equal_to_cpu"] and scenes["voxel_rows_equal_to_cpu"]
    parts = report["parts"]
    assert parts["amp_step"]["model"] == "resnet50-local"  # the torchvision-free ResNet-50
    ddp = parts["ddp"]["runs"]  # every mode's hook on every step; int8 a quarter of fp32
    assert ddp["int8"]["hook_steps"] == ddp["powersgd:1"]["hook_steps"] == ddp["fp16"][
        "hook_steps"] == 3 and ddp["int8"]["ratio_to_fp32"] < 0.26
    pipeline = parts["pipeline"]  # the same pipeline twice on the CPU: equal batches
    assert pipeline["keys_match"] and pipeline["tokens_equal"] and pipeline["json_equal"]
    assert pipeline["images_apart_share"] == 0 and pipeline["depth_max_diff"] == 0
    # the new parts ran their CPU equivalents through the same code: two gloo ranks, a
    # compiled DDP model, Trainer steps (host syncs are counted by CUDA only)
    assert parts["ranks"]["key"] == {**parts["ranks"]["key"], "ranks_agree": True,
                                     "no_sync": True, "uneven_eval_combined": True}
    assert [s for s, _ in parts["ranks"]["ranks"][0]["allreduces_per_micro_step"]] == \
        [False, True] * 3
    assert parts["compile"]["compiled"]["ddp_inside"]
    assert parts["compile"]["key"]["relative_distance"] < 0.05
    assert parts["sync_debug"]["runs"]["fp32"]["skipped_steps"] == 0
    ops_ = parts["ops"]  # the ops part's CPU run against itself, and the loaders' batches
    assert ops_["ops"]["images_apart_share"] == 0 and ops_["loader"]["keys_match"]
    assert ops_["loader"]["views_equal"] and ops_["loader"]["batches"] > 0
    assert "| delivery | ok |" in proc.stdout  # the table of key figures


def test_the_report_is_valid_json_after_every_part(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    stale = '{"half-written": '
    out.write_text(stale)  # a broken report left by an earlier run: replaced, never read
    cmd = [sys.executable, str(TOOL), "--stand-in", "--stand-in-s", "0.5", "--only",
           "ddp,copies", "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = snapshots_while(proc, out, stale)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    seen.append(load(out))
    progress = [len(done(r)) for r in seen if "parts" in r]
    assert progress == sorted(progress) and {1, 2} <= set(progress)  # one write per part
    final = seen[-1]
    assert final["finished"] and list(final["parts"]) == ["copies", "ddp"]
    assert all(p["status"] == "ok" for p in final["parts"].values())


def test_a_part_over_its_timeout_or_raising_is_recorded_and_the_next_runs(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    proc = run_tool("gpu_check", "--stand-in", "--stand-in-s", "0.5", "--only",
                    "delivery,copies,offload", "--timeout-scale", "0.001",
                    "--timeout", "copies=60", "--timeout", "offload=60",
                    "--stand-in-fail", "offload", "--json", out)
    assert proc.returncode == 1, proc.stderr[-4000:]  # the correctness part did not pass
    parts = load(out)["parts"]
    assert parts["delivery"]["status"] == "timeout"
    assert "still running after" in parts["delivery"]["error"]
    assert parts["delivery"]["seconds"] < 0.5
    assert parts["copies"]["status"] == "ok"
    assert parts["offload"]["status"] == "error"
    assert "as --stand-in-fail asked" in parts["offload"]["error"]  # the stderr's tail
    assert "| delivery | timeout |" in proc.stdout


def test_any_failed_part_makes_the_exit_status_non_zero(tmp_path: Path) -> None:
    """Not only delivery: a broken amp_step (say) must reach a wrapper script that reads no
    JSON. A skip is no failure."""
    out = tmp_path / "gc.json"
    failing = run_tool("gpu_check", "--stand-in", "--stand-in-s", "0.01", "--only",
                       "delivery,copies,offload", "--stand-in-fail", "copies", "--json", out)
    assert failing.returncode == 1, failing.stderr[-4000:]
    assert {n: p["status"] for n, p in load(out)["parts"].items()} == {
        "delivery": "ok", "copies": "error", "offload": "ok"}
    assert "parts that did not pass: copies" in failing.stderr
    passing = run_tool("gpu_check", "--stand-in", "--stand-in-s", "0.01", "--only",
                       "delivery,copies", "--json", out)
    assert passing.returncode == 0, passing.stderr[-4000:]


def test_the_default_timeouts_fit_the_budget_most_valuable_first() -> None:
    """The header's and the parts' default timeouts add up to at most the default budget (6.25
    minutes of one command on a lent GPU machine), and --list says so."""
    from shardflow.tools.bench.gpu import BUDGET_S, HEADER_TIMEOUT_S
    from shardflow.tools.bench.gpu import PARTS as SPECS

    assert list(SPECS) == PARTS and BUDGET_S == 375
    total = HEADER_TIMEOUT_S + sum(spec.timeout_s for spec in SPECS.values())
    assert total <= BUDGET_S, total
    listed = dict(line.split("\t") for line in run_tool("gpu_check", "--list",
                                                         check=True).stdout.splitlines())
    assert list(listed) == ["header", *PARTS, "total", "budget"]
    assert listed["total"] == f"{total:g} s" and listed["budget"] == "375 s"


def test_the_budget_cuts_a_part_to_what_is_left_and_skips_those_that_cannot_start(
        tmp_path: Path) -> None:
    """--budget 6 over three stand-ins of 3 s (their timeouts 10 s each, the start floor 10 s
    x 0.05): the first runs whole, the second gets what is left (under 3 s: a timeout that
    names the budget), the third is skipped for the budget; the run ends within it, and the
    report was written after each."""
    out = tmp_path / "gc.json"
    start = time.monotonic()
    proc = run_tool("gpu_check", "--stand-in", "--stand-in-s", "3", "--only",
                    "delivery,copies,offload", "--timeout-scale", "0.05", "--timeout",
                    "delivery=10", "--timeout", "copies=10", "--timeout", "offload=10",
                    "--budget", "6", "--json", out)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-4000:]  # the part cut short did not pass
    report = load(out)
    assert report["finished"] and report["budget_s"] == 6.0 and report["elapsed_s"] <= 6.5
    parts = report["parts"]
    assert parts["delivery"]["status"] == "ok" and parts["delivery"]["timeout_s"] <= 6
    cut = parts["copies"]
    assert cut["status"] == "timeout" and cut["budget_cut_from_s"] == 10
    assert cut["timeout_s"] < 3 and cut["error"].startswith("cut by the budget (--budget 6 s)")
    skipped = parts["offload"]
    assert skipped["status"] == "skipped" and skipped["budget"] and skipped["seconds"] == 0
    assert "the budget" in skipped["reason"] and "| offload | skipped |" in proc.stdout
    assert elapsed < 6 + 5  # the budget, and this tool's own start and end


def test_a_budget_skip_alone_is_no_failure(tmp_path: Path) -> None:
    """Too little left for the last part (under the start floor, 10 s x 0.5): it is skipped
    and the exit status stays 0. A part whose own timeout is under that floor (ddp's 3 s)
    still starts with its timeout left."""
    out = tmp_path / "gc.json"
    proc = run_tool("gpu_check", "--stand-in", "--stand-in-s", "0.5", "--only", "ddp,ranks",
                    "--timeout-scale", "0.5", "--timeout", "ddp=3", "--timeout", "ranks=10",
                    "--budget", "4", "--json", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    parts = load(out)["parts"]
    assert parts["ddp"]["status"] == "ok" and parts["ddp"]["timeout_s"] == 3
    assert parts["ranks"]["status"] == "skipped" and parts["ranks"]["budget"]


def parts_of(parent_pid: int) -> list[int]:
    """Live processes started as parts by `parent_pid` (orphans, once it is killed)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--parent-pid" in args and str(parent_pid).encode() in args:
            found.append(int(cmdline.parent.name))
    return found


def test_a_rerun_after_a_kill_starts_afresh_and_completes(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    cmd = [sys.executable, str(TOOL), "--stand-in", "--stand-in-s", "60", "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not parts_of(proc.pid):
        time.sleep(0.05)  # until the first part's process runs (for 60 s, unless ended)
    assert parts_of(proc.pid), "no part started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = load(out)  # what the kill left is a valid report
    assert not killed["finished"] and killed["parts"]["delivery"]["status"] == "pending"
    deadline = time.monotonic() + 10
    while parts_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not parts_of(proc.pid), "the running part outlived the killed run"
    rerun = run_tool("gpu_check", "--stand-in", "--stand-in-s", "0.05", "--json", out)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    report = load(out)
    assert report["finished"] and list(report["parts"]) == PARTS
    assert all(p["status"] == "ok" for p in report["parts"].values())
    assert not list(tmp_path.glob(".*.tmp"))


def test_without_cuda_it_says_why_writes_the_header_and_exits_0(tmp_path: Path) -> None:
    """0 for a CPU build of torch; for a CUDA build that sees no GPU, NO_GPU_SEEN (3)."""
    if gpu_available():
        pytest.skip("this machine has CUDA: the no-CUDA path cannot be shown here")
    out = tmp_path / "gc.json"
    proc = run_tool("gpu_check", "--json", out)
    header = load(out)["header"]
    assert proc.returncode == (3 if header["cuda_build"] else 0), proc.stderr[-4000:]
    assert header["cuda_available"] is False and header["cuda_state"] in proc.stdout
    assert all(p["status"] == "skipped" for p in load(out)["parts"].values())
