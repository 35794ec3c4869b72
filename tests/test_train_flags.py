"""tools/train.py's loader flags (--loader-threads, --prefetch, --tuning-file, --no-tuning),
the bottleneck advice in its terms, and the held-out slice by key hash of a one-shard --data."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from conftest import ROOT, run_tool

from shardflow.builtin import make_image_folder
from shardflow.loading.holdout import KeyHoldout, held_out
from shardflow.loading.options import cores
from shardflow.loading.shardlist import ShardSpec, Source, resolve_source
from shardflow.loading.tuning import Tuning
from shardflow.trainers import bottleneck
from shardflow.trainers.wiring import TaskOptions, build_task, loader_options, split_eval


def train_tool(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The train command's module (tools/train.py)."""
    from shardflow.tools import train

    return train


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one")
    src = make_image_folder(root / "src", per_class=6, size=32)
    run_tool("make_shards", "imagefolder", src, root / "shards", "--max-count", 1000,
             "--shuffle-seed", 0, check=True)
    assert len(json.loads((root / "shards" / "manifest.json").read_text())["shards"]) == 1
    return root / "shards"


# -- the bottleneck advice speaks train.py's flags ----------------------------------------------

def _loader(kind: str, **cfg: object) -> SimpleNamespace:
    options = {"normalize": False, "prefetch": 4, "threads": 1, **cfg}
    return SimpleNamespace(kind=kind, device="cuda:0", decode="cpu", backend="dali",
                           cfg=SimpleNamespace(**options))


ADVICE_CASES = {  # branch -> (loader, CUDA here?, a flag it must name)
    "gpu-decode": (_loader("image"), True, "--decode"),
    "gpu-decode, batches on the cpu": (SimpleNamespace(**{**vars(_loader("image")),
                                                          "device": "cpu"}), True, "--device"),
    "gpu-decode, portable": (SimpleNamespace(**{**vars(_loader("pointcloud")),
                                                "backend": "portable"}), True, "--backend"),
    "normalize": (_loader("image", normalize=True), False, None),
    "prefetch": (_loader("image", prefetch=2), False, "--prefetch"),
    "text": (_loader("text"), False, "--tokenizer"),
    "pointcloud": (_loader("pointcloud"), False, "--num-points"),
    "image threads": (_loader("image"), False, None),
    "no config": (SimpleNamespace(kind="image"), False, None),
}


@pytest.mark.parametrize("case", list(ADVICE_CASES))
def test_every_flag_the_bottleneck_advice_names_is_a_train_py_flag(case, monkeypatch):
    loader, cuda, expected = ADVICE_CASES[case]
    flags = {o for a in train_tool(monkeypatch).build_parser()._actions for o in a.option_strings}
    monkeypatch.setattr(bottleneck, "_cuda", lambda: cuda)
    advice = bottleneck.report(wait_s=40.0, compute_s=60.0, loader=loader)["advice"]
    named = set(re.findall(r"--[a-z][a-z-]*", advice))
    assert named <= flags, (advice, named - flags)
    assert expected is None or expected in named, advice
    assert advice.startswith("input-bound") and "device='gpu'" not in advice


def test_every_branch_of_the_advice_is_covered(monkeypatch):
    advices = set()
    for loader, cuda, _ in ADVICE_CASES.values():
        monkeypatch.setattr(bottleneck, "_cuda", lambda cuda=cuda: cuda)
        advices.add(bottleneck.report(40.0, 60.0, loader)["advice"])
    assert len(advices) == len(ADVICE_CASES)
    monkeypatch.setattr(bottleneck, "_cuda", lambda: False)
    thread_advice = bottleneck._advice(0.4, _loader("image", threads=cores() + 1))
    assert "--loader-threads" not in thread_advice and "more cores" in thread_advice
    if cores() > 1:
        assert "--loader-threads" in bottleneck._advice(0.4, _loader("image", threads=1))


# -- threads, prefetch and the tuning file -------------------------------------------------------

def _opts(data: Path, **flags: Any) -> TaskOptions:
    return TaskOptions(task="image", data=str(data), device="cpu", backend="portable", **flags)


def _settings(data: Path, local_world: int = 1, **flags: Any) -> tuple[Any, dict[str, Any]]:
    """The training loader's config and summary.json's loader settings, as built for
    `shardflow train` on one-shard `data` (the loaders closed)."""
    split = split_eval(resolve_source(data), None)
    built = build_task(_opts(data, batch_size=8, size=24, **flags), split, 0, 1, local_world)
    built.loader.close()
    built.evaluation.close()
    return built.loader.cfg, built.loader_settings


def test_loader_threads_divide_the_cores_among_the_ranks_on_this_node(one_shard):
    cfg, settings = _settings(one_shard, local_world=2)
    assert cfg.threads == settings["threads"] == max(1, cores() // 2)
    assert "local_world_size=2 ranks on this node" in settings["threads_from"]
    assert (cfg.prefetch, settings["prefetch"]) == (2, 2) and settings["tuned"] == {}
    assert settings["prefetch_from"] == "the loaders' default"
    cfg, settings = _settings(one_shard, local_world=8, loader_threads=3, prefetch=5)
    assert (cfg.threads, cfg.prefetch) == (3, 5)
    assert (settings["threads_from"], settings["prefetch_from"]) == ("--loader-threads",
                                                                      "--prefetch")
    text = TaskOptions(task="text", data=str(one_shard))
    assert not {"threads", "local_world_size"} & set(loader_options(text, 4))


def test_a_tuning_file_fills_in_what_the_flags_leave_and_no_more(one_shard, tmp_path):
    path = tmp_path / "tuning.json"
    Tuning("cpu", "stream", 3, 5, 1000.0).save(path)
    cfg, settings = _settings(one_shard, 4, tuning_file=path)
    assert (cfg.threads, cfg.prefetch, cfg.decode) == (3, 5, "cpu")
    assert settings["threads_from"] == settings["prefetch_from"] == "the tuning file"
    assert settings["tuned"] == {"decode": "cpu", "reader": "stream", "threads": 3,
                                 "prefetch": 5} and settings["tuning_file"] == str(path)
    # explicit flag > tuning file > divided default
    cfg, settings = _settings(one_shard, 4, tuning_file=path, loader_threads=7)
    assert (cfg.threads, cfg.prefetch) == (7, 5)
    assert settings["threads_from"] == "--loader-threads" and "threads" not in settings["tuned"]
    cfg, settings = _settings(one_shard, 4, tuning_file=path, use_tuning=False)
    assert cfg.threads == max(1, cores() // 4) and settings["tuned"] == {}
    assert settings["tuning_file"] is None


def test_loader_flags_are_refused_where_they_mean_nothing(one_shard, tmp_path, monkeypatch):
    split = split_eval(resolve_source(one_shard), None)
    text = TaskOptions(task="text", data=str(one_shard), loader_threads=2)
    with pytest.raises(ValueError, match="--loader-threads"):
        build_task(text, split, 0, 1)
    with pytest.raises(FileNotFoundError, match="--tuning-file"):
        build_task(_opts(one_shard, tuning_file=tmp_path / "none.json"), split, 0, 1)
    parser = train_tool(monkeypatch).build_parser()
    base = ["--task", "image", "--data", "d", "--out", "o", "--steps", "1"]
    assert parser.parse_args(base).use_tuning is True
    args = parser.parse_args([*base, "--loader-threads", "3", "--prefetch", "4", "--no-tuning"])
    assert (args.loader_threads, args.prefetch, args.use_tuning) == (3, 4, False)
    for bad in (["--loader-threads", "0"], ["--prefetch", "0"],
                ["--no-tuning", "--tuning-file", "t.json"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, *bad])


# -- a held-out slice by key hash ------------------------------------------------------------------

def test_key_holdout_is_a_stable_tenth_whatever_the_process():
    keys = [f"sample_{i:05d}" for i in range(2000)]
    held = [k for k in keys if held_out(k, 10)]
    assert 150 < len(held) < 250
    train, evaluation = KeyHoldout("train", 10), KeyHoldout("eval", 10)
    assert all(train.keeps(k) != evaluation.keeps(k) for k in keys)
    code = ("import sys; from shardflow.loading.holdout import held_out; "
            "print(','.join(k for k in sys.argv[1:] if held_out(k, 10)))")
    for seed in ("1", "2"):  # Python's own hash() of a str changes with PYTHONHASHSEED
        out = subprocess.run([sys.executable, "-c", code, *keys[:300]], capture_output=True,
                             text=True, check=True, cwd=ROOT,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        assert out.stdout.strip().split(",") == [k for k in keys[:300] if held_out(k, 10)]
    with pytest.raises(ValueError, match="percent"):
        KeyHoldout("eval", 0)


def _keys(loader) -> tuple[list[str], int]:
    keys, batches = [], 0
    for batch in loader:
        keys += batch.keys
        batches += 1
    return keys, batches


def test_one_shard_splits_by_key_into_disjoint_covering_sets(one_shard):
    source = resolve_source(one_shard)
    split = split_eval(source, None)
    assert split.by_key == 10 and split.train == split.held == source
    assert split.how.startswith("held out 10% of samples by key hash (no --eval-data, 1 shard)")
    built = build_task(_opts(one_shard, batch_size=8, size=24, loader_threads=1), split, 0, 1)
    with built.loader as loader, built.evaluation as evaluation:
        train, train_batches = _keys(loader)
        held, held_batches = _keys(evaluation)
        # an epoch keeps its batches (len), each without the other side's samples
        assert train_batches == len(loader) and held_batches == len(evaluation)
        assert not loader.skipped and not evaluation.skipped  # held out is not skipped
    assert set(train).isdisjoint(held) and len(set(train)) == len(train)
    assert len(train) + len(held) == source.total == 60 and 0 < len(held) < 20
    assert all(held_out(k, 10) for k in held) and not any(held_out(k, 10) for k in train)


def test_whole_shards_are_held_out_while_every_rank_keeps_one():
    two = Source((ShardSpec("s/train-000000.tar", 30), ShardSpec("s/train-000001.tar", 30)))
    split = split_eval(two, None)
    assert split.by_key is None and split.how.endswith("train-000001.tar")
    assert [s.url for s in split.train.shards] == ["s/train-000000.tar"]
    by_key = split_eval(two, None, world_size=2)  # one held out would leave a rank without
    assert by_key.by_key == 10 and "(no --eval-data, 2 shards for 2 ranks)" in by_key.how
    assert by_key.train == by_key.held == two


def test_train_py_trains_one_shard_holding_out_by_key_and_resumes_alike(one_shard, tmp_path,
                                                                        monkeypatch):
    out = tmp_path / "run"
    common = ["--task", "image", "--data", one_shard, "--out", out, "--batch-size", 8,
              "--size", 24, "--checkpoint-every", 3, "--log-every", 1, "--log-keys",
              "--precision", "fp32", "--quiet"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # not under torchrun: only divides the cores
    first = run_tool("train", *common, "--steps", 3, check=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["held_out"].startswith("held out 10% of samples by key hash (no --eval-data,"
                                          " 1 shard)"), summary["held_out"]
    assert summary["loader"]["threads"] == max(1, cores() // 2)
    assert "local_world_size=2 ranks on this node" in summary["loader"]["threads_from"]
    assert summary["skipped_samples"] == 0 and "held out 10%" in first.stdout
    resumed = run_tool("train", *common, "--steps", 6, "--prefetch", 3, check=True)
    again = json.loads((out / "summary.json").read_text())
    assert again["resumed_at_step"] == 3 and again["held_out"] == summary["held_out"]
    assert again["steps_this_run"] == 3  # what this process ran, said as such
    assert resumed.stdout.startswith("3 steps (resumed at step 3, to step 6)"), resumed.stdout
    assert (again["loader"]["prefetch"], again["loader"]["prefetch_from"]) == (3, "--prefetch")
    steps = [json.loads(line) for line in (out / "keys.jsonl").read_text().splitlines()]
    trained = {k for record in steps for k in record["keys"]}
    assert {record["step"] for record in steps} == set(range(6))
    assert trained and not any(held_out(k, 10) for k in trained)
    # the held-out slice is part of what a checkpoint continues: not resumed into training it
    other = run_tool("train", *common, "--steps", 9, "--eval-data", one_shard)
    assert other.returncode == 2 and "held_out_by_key: '10%' there, None here" in other.stderr


def test_torchrun_two_ranks_on_two_shards_hold_out_the_same_keys(tmp_path):
    src = make_image_folder(tmp_path / "src", per_class=6, size=32)
    run_tool("make_shards", "imagefolder", src, tmp_path / "two", "--max-count", 30,
             "--shuffle-seed", 0, check=True)
    out = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tools" / "train.py"), "--task", "image", "--data", str(tmp_path / "two"),
         "--out", str(out), "--steps", "4", "--batch-size", "8", "--size", "24", "--device",
         "cpu", "--log-keys", "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "(no --eval-data, 2 shards for 2 ranks)" in summary["held_out"]
    # torchrun's LOCAL_WORLD_SIZE=2: each rank decodes with half the cores
    assert summary["loader"]["threads"] == max(1, cores() // 2)
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    for line in (out / "keys.jsonl").read_text().splitlines():
        record = json.loads(line)
        seen[record["rank"]].update(record["keys"])
    assert seen[0] and seen[1] and seen[0].isdisjoint(seen[1])
    assert not any(held_out(k, 10) for k in seen[0] | seen[1])


def test_one_text_shard_splits_by_key_too(tmp_path):
    from shardflow.builtin import make_text_corpus

    docs = make_text_corpus(tmp_path / "docs", docs=60)
    run_tool("make_shards", "text", docs, tmp_path / "text", "--max-count", 1000, check=True)
    split = split_eval(resolve_source(tmp_path / "text"), None)
    opts = TaskOptions(task="text", data=str(tmp_path / "text"), batch_size=4, seq_len=64,
                       device="cpu", backend="portable")
    built = build_task(opts, split, 0, 1)
    with built.loader as loader, built.evaluation as evaluation:
        train, held = set(_keys(loader)[0]), set(_keys(evaluation)[0])
        assert not loader.skipped and not evaluation.skipped
    assert train | held == {p.stem for p in docs.iterdir()} and held
    assert all(held_out(k, 10) for k in held) and not any(held_out(k, 10) for k in train)


def test_offload_and_activation_checkpointing_flags_take_effect(one_shard, tmp_path):
    """--offload-optimizer and --activation-checkpointing on train.py's command line: the run
    trains and summarises, and summary.json's "setup" (read from the built optimizer and
    model, not the flags) and the checkpoint say what took effect."""
    import torch

    common = ["--task", "image", "--data", one_shard, "--batch-size", 8, "--size", 24,
              "--steps", 3, "--checkpoint-every", 3, "--precision", "fp32", "--quiet"]
    runs = {"flags": ["--offload-optimizer", "--activation-checkpointing"], "plain": []}
    setups, states = {}, {}
    for name, flags in runs.items():
        run_tool("train", *common, "--out", tmp_path / name, *flags, check=True)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["final_loss"] == summary["final_loss"]
        setups[name] = summary["setup"]
        states[name] = torch.load(tmp_path / name / "ckpt-00000003.pt", weights_only=True)
    assert setups["flags"] == {"optimizer_state": "host", "fused_optimizer": False,
                               "activation_checkpointing": True, "compiled": False,
                               "ddp": False, "augment": None}
    assert setups["plain"] == {"optimizer_state": "cpu", "fused_optimizer": True,
                               "activation_checkpointing": False, "compiled": False,
                               "ddp": False, "augment": None}
    assert states["flags"]["fingerprint"]["offload_optimizer"] is True
    assert states["plain"]["fingerprint"]["offload_optimizer"] is False


def test_held_out_classes_training_never_met_are_named(tmp_path):
    """Class-sorted shards (a conversion without --shuffle-seed): the held-out shard holds a
    class no training step met, so its accuracy is chance at best; the run says so, and
    names the fix."""
    src = make_image_folder(tmp_path / "src", per_class=3, size=24)  # 10 classes
    run_tool("make_shards", "imagefolder", src, tmp_path / "shards", "--max-count", 3,
             "--quiet", check=True)
    out = tmp_path / "run"
    proc = run_tool("train", "--task", "image", "--data", tmp_path / "shards", "--out", out,
                    "--steps", 4, "--batch-size", 3, "--size", 24, "--precision", "fp32",
                    "--quiet", check=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["held_out"].endswith("train-000009.tar")
    assert summary["eval_classes_unseen_in_training"] == [9]
    assert "100% of the held-out samples are of classes training never met (9)" in proc.stderr
    assert "--shuffle-seed" in proc.stderr


def test_a_short_run_is_not_all_warm_up():
    from shardflow.tools.train import warmup_steps

    assert [warmup_steps(None, n) for n in (20, 60, 1000)] == [2, 6, 20]
    assert warmup_steps(50, 20) == 50  # as given
