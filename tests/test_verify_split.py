"""verify_shards on good shards, its split view (the loaders' own), and its JSON report."""

from __future__ import annotations

import json
import tarfile
import tempfile
from pathlib import Path

import pytest
from conftest import make_image_folder, run_tool

from shardflow.tools.bench.core import Timings, alternate


def _keys_by_shard(folder: Path) -> dict[str, set[str]]:
    keys = {}
    for tar in sorted(folder.glob("*.tar")):
        with tarfile.open(tar) as t:
            keys[tar.name] = {m.name.split(".", 1)[0] for m in t.getmembers()}
    return keys


def test_the_split_view_is_what_the_loaders_read(tmp_path):
    from shardflow import image_loader

    src = make_image_folder(tmp_path / "src", classes=2, per_class=5)
    run_tool("make_shards", "imagefolder", src, tmp_path / "o", "--max-count", 2, check=True)
    report = tmp_path / "report.json"
    proc = run_tool("verify_shards", tmp_path / "o", "--world-size", 2, "--epoch", 1,
                    "--seed", 5, "--json", report, "--quiet", check=True)
    assert "split over 2 ranks, epoch 1" in proc.stdout and "no problems" in proc.stdout
    doc = json.loads(report.read_text())
    assert doc["ok"] and doc["samples"] == 10 and doc["manifest_samples"] == 10
    assert [s["samples"] for s in doc["shards"]] == [2] * 5 and doc["problems_by_reason"] == {}
    split = doc["split"]
    assert split["samples_per_rank"] == 4 and split["dropped"] == 2  # 3 + 2 shards: even at 4
    by_shard = _keys_by_shard(tmp_path / "o")
    for rank in split["ranks"]:
        loader = image_loader(tmp_path / "o", batch_size=2, size=16, device="cpu", threads=1,
                              seed=5, rank=rank["rank"], world_size=2, use_tuning=False)
        loader.set_epoch(1)
        with loader:
            read = {k for batch in loader for k in batch.keys}
        shown = set().union(*(by_shard[name] for name in rank["shards"]))
        assert len(read) == split["samples_per_rank"] and read <= shown
        assert rank["samples_in_shards"] == len(shown)


def test_a_split_the_loaders_would_refuse_is_a_warning_and_workers_are_gone(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, per_class=3)
    run_tool("make_shards", "imagefolder", src, tmp_path / "o", "--max-count", 2, check=True)
    crowded = run_tool("verify_shards", tmp_path / "o", "--world-size", 4, "--quiet")
    assert crowded.returncode == 0  # a warning, not a data problem
    assert "warning: the loaders would refuse it: 3 shards cannot feed 4 ranks" in crowded.stdout
    assert "(but see the split warning above)" in crowded.stdout
    gone = run_tool("verify_shards", tmp_path / "o", "--world-size", 2, "--workers", 2)
    assert gone.returncode == 2 and "--workers is gone" in gone.stderr


def test_verify_brace_pattern_without_manifest(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=1, per_class=4)
    run_tool("make_shards", "imagefolder", src, tmp_path / "o", "--max-count", 2, check=True)
    proc = run_tool("verify_shards", str(tmp_path / "o" / "train-{000000..000001}.tar"),
                    check=True)
    assert "(no manifest)" in proc.stdout and "4 samples" in proc.stdout


def test_timings_medians_and_ratios():
    t = Timings({"base": [2.0, 9.0, 4.0], "ours": [1.0, 1.0, 5.0]})
    # A ratio pairs the rounds: 2/1, 9/1, 4/5 -> median 2 (the medians' ratio would be 4)
    assert t.median("base") == 4.0 and t.ratio("ours", "base") == 2.0
    drifting = Timings({"base": [1.0, 2.0, 4.0, 8.0], "ours": [0.5, 1.0, 2.0, 4.0]})
    assert drifting.ratio("ours", "base") == 2.0  # a machine slowing down round by round
    assert t.rate("ours", work=10.0) == 10.0
    order: list[str] = []
    alternate({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=2,
              warmup=1)
    assert order == ["a", "b", "a", "b", "a", "b"]  # warm-ups, then A B A B
    # With `expect`, every epoch must read the whole corpus: a contender reading half of it
    # would read as twice as fast. Recorded per timed run; any other count stops it.
    epochs = iter([24, 24, 24, 12])
    with pytest.raises(RuntimeError, match=r"'half' read 12 items of 24"):
        alternate({"whole": lambda: 24, "half": lambda: next(epochs)}, repeats=3, expect=24)
    assert alternate({"a": lambda: 24}, repeats=2, expect=24).counts == {"a": [24, 24]}


def test_gpu_check_says_there_is_no_gpu_and_exits_0():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tools/gpu_check.py would run the real checks")
    proc = run_tool("gpu_check", "--json", Path(tempfile.mkdtemp()) / "gpu.json")
    # a CPU-only torch build is told apart from a CUDA build that sees no GPU
    build = "CPU-only build" if torch.version.cuda is None else "no GPU is visible"
    assert proc.returncode == 0 and "no CUDA here" in proc.stdout and build in proc.stdout


def test_tuning_file_round_trip_and_what_auto_takes_from_it(tmp_path, caplog):
    import logging

    from shardflow.loading.tuning import Tuning, apply, load

    path = tmp_path / "tuning.json"
    assert load(path) is None  # no file: nothing changes
    Tuning("cpu", "stream", 1, 3, 1234.5, [{"reader": "stream"}]).save(path)
    assert load(path) == Tuning("cpu", "stream", 1, 3, 1234.5, [{"reader": "stream"}],
                                load(path).machine, load(path).measured)
    with caplog.at_level(logging.INFO):
        tuned = apply("image", {"device": "auto", "prefetch": 2}, path, dali_readable=True)
    # the file's device is where decoding ran: the decode option
    assert tuned == {"device": "auto", "decode": "cpu", "reader": "stream", "threads": 1,
                     "prefetch": 2}
    assert "from the tuning file" in caplog.text  # the choice and its source are logged
    explicit = apply("image", {"decode": "cpu", "reader": "dali", "threads": 2, "prefetch": 2},
                     path, dali_readable=True)
    assert explicit == {"decode": "cpu", "reader": "dali", "threads": 2, "prefetch": 2}
    # the hardware decoder's share is a GPU choice: kept in the file, applied to GPU loaders
    gpu = Tuning("gpu", "dali", 2, 4, 5000.0, [], hw_decoder_load=0.9)
    assert gpu.choices()["hw_decoder_load"] == 0.9
    assert "hw_decoder_load" not in Tuning("cpu", "dali", 2, 4, 1.0).choices()
    # where resize/flip/normalize run is a CPU choice, filled in only where left "auto"
    cpu = tmp_path / "cpu.json"
    Tuning("cpu", "dali", 2, 4, 1.0, resize_on="dali").save(cpu)
    assert apply("image", {}, cpu, dali_readable=True)["resize_on"] == "dali"
    assert apply("image", {"resize_on": "torch"}, cpu, dali_readable=True)["resize_on"] == \
        "torch"
    assert "resize_on" not in gpu.choices()
    # measured apart for float output: a normalizing loader takes that one
    both = tmp_path / "both.json"
    Tuning("cpu", "dali", 2, 4, 1.0, resize_on="torch", resize_on_float="dali").save(both)
    assert apply("image", {}, both, dali_readable=True)["resize_on"] == "torch"
    assert apply("image", {"normalize": True}, both, dali_readable=True)["resize_on"] == "dali"
    assert apply("image", {"normalize": True}, cpu, dali_readable=True)["resize_on"] == "dali"


def test_a_tuned_choice_applies_only_where_it_is_possible(tmp_path, caplog):
    import logging

    from shardflow.loading.tuning import Tuning, apply

    path = tmp_path / "tuning.json"
    Tuning("gpu", "dali", 2, 4, 5000.0, hw_decoder_load=0.9).save(path)
    with caplog.at_level(logging.INFO):
        remote = apply("image", {}, path, dali_readable=False)
    assert "reader" not in remote and "streaming reader reads them" in caplog.text
    # GPU decoding is not applied to a loader whose batches stay on the CPU
    assert "decode" not in apply("image", {"device": "cpu"}, path, dali_readable=True)
    assert apply("image", {"device": "auto"}, path, dali_readable=True)["decode"] == "gpu"
    # other modalities take what applies to them: text has no decoder and no DALI threads
    assert apply("text", {}, path, dali_readable=True) == {"reader": "dali", "prefetch": 4}
    cloud = apply("pointcloud", {}, path, dali_readable=True)
    assert cloud == {"decode": "gpu", "reader": "dali", "threads": 2, "prefetch": 4}


def test_a_tuning_file_from_another_machine_is_ignored(tmp_path):
    from shardflow.loading.tuning import Tuning, load

    path = tmp_path / "tuning.json"
    Tuning("gpu", "dali", 64, 4, 9000.0, machine={"cpus": 64, "gpu": "H200"}).save(path)
    assert load(path) is None


@pytest.mark.parametrize("edit", ["null", '"fast"', "[1, 2]", "no version", "threads",
                                  "portable", "resize_on", "device", "split"])
def test_a_tuning_file_edited_into_nonsense_is_ignored_with_a_warning(tmp_path, caplog, edit):
    """What a hand edit can leave: ignored, named in a warning, never a crash of every loader
    (it was AttributeError, OverflowError or a loader refusing its own option)."""
    import logging

    from shardflow.image import choose
    from shardflow.loading.tuning import Tuning, apply, load

    path = tmp_path / "tuning.json"
    Tuning("cpu", "stream", 1, 3, 100.0).save(path)
    doc = json.loads(path.read_text())
    changed = {"no version": {k: v for k, v in doc.items() if k != "version"},
               "threads": {**doc, "threads": "many"}, "portable": {**doc, "portable": [4, 2]},
               "resize_on": {**doc, "resize_on": 3}, "device": {**doc, "device": "GPU"}}
    if edit in changed:
        path.write_text(json.dumps(changed[edit]))
    elif edit == "split":  # a number past float's range: the point is left out, the rest kept
        doc["backend_split"] = [{"side_ratio": 10**400, "dali": 1, "portable": 2}]
        path.write_text(json.dumps(doc))
        assert load(path) is not None and choose.tuned_split(path) == choose.LARGE
        return
    else:
        path.write_text(edit)
    with caplog.at_level(logging.WARNING):
        assert load(path) is None
        assert apply("image", {"prefetch": 2}, path, dali_readable=True, dali=False) == \
            {"prefetch": 2}
        assert choose.tuned_split(path) == choose.LARGE
    assert f"ignoring tuning file {path}" in caplog.text


def test_image_loader_uses_the_tuning_file_unless_told_not_to(tmp_path):
    from shardflow import image_loader
    from shardflow.loading.tuning import Tuning

    src = make_image_folder(tmp_path / "src", classes=2, per_class=3)
    run_tool("make_shards", "imagefolder", src, tmp_path / "o", "--max-count", 3, check=True)
    path = tmp_path / "tuning.json"
    Tuning("cpu", "stream", 1, 3, 100.0, resize_on="dali").save(path)
    tuned = image_loader(tmp_path / "o", batch_size=2, tuning_file=path)
    assert tuned.reader == "stream" and tuned.cfg.threads == 1 and tuned.cfg.prefetch == 3
    assert tuned.cfg.resize_on == "dali" and len(next(iter(tuned)).keys) == 2
    plain = image_loader(tmp_path / "o", batch_size=2, tuning_file=path, use_tuning=False)
    assert plain.reader == "dali"
    # a tuned reader='dali' never breaks shards DALI cannot read (no .idx): streaming reader
    Tuning("cpu", "dali", 1, 3, 100.0).save(path)
    for idx in (tmp_path / "o").glob("*.idx"):
        idx.unlink()
    with image_loader(tmp_path / "o", batch_size=2, tuning_file=path) as unindexed:
        assert unindexed.reader == "stream" and len(next(iter(unindexed)).keys) == 2
