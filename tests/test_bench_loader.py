"""tools/bench_loader.py end to end on tiny corpora: every modality writes its table, JSON,
markdown and chart, compares equal work, and leaves no work folder behind."""

from __future__ import annotations

import gc
import json
import shutil
import time
from collections import Counter

import pytest
from conftest import run_tool

from shardflow.loading.readers import dali_importable


@pytest.mark.parametrize("modality,size", [("image", ["--images", 24]),
                                           ("pointcloud", ["--clouds", 60])])
@pytest.mark.backend
def test_bench_loader_figures(tmp_path, modality, size):
    out = tmp_path / "bench.json"
    proc = run_tool("bench_loader", "--modality", modality, *size, "--repeats", 1,
                    "--batch-size", 8, "--epochs", 2, "--work", tmp_path / "work", "--json",
                    out, "--plot", tmp_path / "bench.png", check=True)
    result = json.loads(out.read_text())
    figures = result if modality == "image" else result["shardflow"]
    assert figures["time_to_first_batch_s"] > 0 and figures["overlap"] > 0
    assert len(figures["rss_mb_after_each_epoch"]) == 2
    _check_loader_figures(figures, epochs=2)
    _check_rates(result, modality)
    if modality == "image":
        # The portable backend is always measured; the DALI baselines where DALI imports.
        dali = {"DALI by hand", "DALI decode only"} if dali_importable() else set()
        assert set(result["images_per_s"]) >= {"shardflow", "shardflow portable", *dali}
        assert result["ratios"]["shardflow portable/tv"] > 0
        assert all(v > 0 for v in result["ratios"].values())
    else:
        assert set(result["clouds_per_s"]) == {"shardflow", "plain loop"}
        assert result["voxelize"]["points_per_s_per_core"] > 0
    assert out.with_suffix(".md").read_text().strip() in proc.stdout
    if modality == "image":  # 3 batches of 8: the table says so, and shows no ratio
        assert "too small to measure: 24 images are 3 batches" in proc.stdout
        assert "| ratio" not in proc.stdout
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert not (tmp_path / "work").exists(), "the benchmark's work folder was left behind"


# Short names the image ratios use for their baselines (tools/bench_loader.py's BASELINES).
_ALIASES = {"tv": "torchvision-style uint8", "wds": "webdataset + PIL", "dali": "DALI by hand",
            "decode": "DALI decode only", "canonical float": "torchvision-style float",
            "tv RandAugment+mixup": "torchvision-style RandAugment+mixup"}


def _check_loader_figures(figures: dict, epochs: int) -> None:
    """What loader_figures' arithmetic guarantees, whatever the machine's speed."""
    # The timed epoch sleeps, in total, exactly as long as the loader's epoch took: it can
    # only take longer (1.0: fully overlapped; ~2: serial).
    assert figures["overlap"] >= 1.0, figures
    rss = figures["rss_mb_after_each_epoch"]
    assert len(rss) == epochs and all(v > 0 for v in rss)
    assert figures["rss_growth_mb_per_epoch"] == pytest.approx(
        (rss[-1] - rss[0]) / (epochs - 1), abs=0.011)
    # The peak is at least every RSS sample, up to how the two are read: ru_maxrss and
    # /proc/self/statm come from per-CPU kernel counters that lag (measured: up to 0.4 MB
    # apart), and peak_rss_mb is ru_maxrss (KiB) / 1e3, 2.4% low (tools/bench/core.py).
    assert figures["peak_rss_mb"] >= 0.95 * max(rss), figures


def _check_rates(result: dict, modality: str) -> None:
    """Every rate, ratio and per-item cost is over the same contenders, and each ratio is
    the quotient of the two rates it names (to their rounding)."""
    unit = "images" if modality == "image" else "clouds"
    rates, work = result[f"{unit}_per_s"], result[unit]
    assert set(result[f"cpu_s_per_{unit[:-1]}"]) == set(rates)
    assert all(v > 0 for v in rates.values()) and work == (24 if unit == "images" else 60)
    # Every timed epoch of every contender read the whole corpus (half of it would read as
    # twice the speed); shardflow.tools.bench.core.alternate stops the benchmark on any other count.
    assert result[f"{unit}_read"] == {name: [work] * result["repeats"] for name in rates}
    assert result["batch_size"] == 8
    if modality == "image":
        ratios = result["ratios"]
        # shardflow (uint8; with RandAugment+mixup, the same recipe) against every baseline:
        # each one measured has its ratio
        against = {_ALIASES.get(b, b) for a, b in (k.split("/") for k in ratios)
                   if a.startswith("shardflow")}
        assert {n for n in rates if not n.startswith("shardflow")} <= against, ratios
    else:
        ratios = {"shardflow/plain loop": result["ratio shardflow/plain loop"]}
        points = result["points_per_cloud"]
        for name, rate in rates.items():  # the same medians, counted in points
            assert result["points_per_s"][name] == pytest.approx(rate * points, rel=1e-3)
        v = result["voxelize"]
        assert v["batch"] == [8, result["num_points"]] and v["grid"] == result["grid"]
        assert v["ratio_to_reference"] == pytest.approx(
            v["points_per_s_per_core"] / v["reference_points_per_s_per_core"], abs=6e-4)
    for key, ratio in ratios.items():
        ours, base = key.split("/")
        a, b = rates[ours], rates[_ALIASES.get(base, base)]
        slack = 5e-4 + (a / b) * (0.05 / a + 0.05 / b) * 1.01  # rates to 0.1, ratios to 0.001
        assert abs(ratio - a / b) <= slack, (key, ratio, a, b)


class _Clock:
    """Stands in for `time` in shardflow.tools.bench.core: sleeping advances it, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _TimedLoader:
    """`batches` per pass, each `cost` seconds of the clock, the very first `cold` more. A
    `background` loader produces the next batch while the consumer holds the last one."""

    def __init__(self, clock: _Clock, batches: int, cost: float, cold: float,
                 background: bool) -> None:
        self.clock, self.batches, self.cost, self.cold = clock, batches, cost, cold
        self.background, self.closed = background, False

    def __iter__(self):
        ready = self.clock.now + self.cost + self.cold
        self.cold = 0.0
        for i in range(self.batches):
            if self.background:
                self.clock.now = max(self.clock.now, ready)
            else:
                self.clock.now = ready if i == 0 else self.clock.now + self.cost
            handed = self.clock.now
            yield i
            ready = handed + self.cost

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("background, overlap", [(False, 2.0), (True, 1.25)])
def test_loader_figures_measure_first_batch_and_overlap(monkeypatch, background, overlap):
    """On a clock the test drives: the first batch of a new loader costs its start-up and
    one batch; a serial loader's overlap is 2, one that prepares the next batch while the
    step runs reaches 1 + 1/batches (its first batch of a pass is never prefetched)."""
    from shardflow.tools.bench import core

    clock = _Clock()
    monkeypatch.setattr(core, "time", clock)
    resident = iter([30.0, 31.0, 33.0])  # MB after each epoch
    monkeypatch.setattr(core, "rss_mb", lambda: next(resident))
    loaders: list[_TimedLoader] = []

    def make() -> _TimedLoader:
        loaders.append(_TimedLoader(clock, batches=4, cost=0.25, cold=1.5,
                                    background=background))
        return loaders[-1]

    figures = core.loader_figures(make, epochs=3)
    assert len(loaders) == 1 and loaders[0].closed
    assert figures["time_to_first_batch_s"] == 1.75
    assert figures["overlap"] == overlap
    assert figures["rss_mb_after_each_epoch"] == [30.0, 31.0, 33.0]
    assert figures["rss_growth_mb_per_epoch"] == 1.5
    _check_loader_figures(figures, epochs=3)


# -- the optional contenders: MosaicML Streaming and LitData (the bench extra) ------------------

def _needs(name: str) -> None:
    """pytest.importorskip for an optional contender's package (MosaicML Streaming's is loaded
    by shardflow.tools.bench.peers.streaming_base: its own __init__ needs torchvision)."""
    from shardflow.tools.bench import peers

    package, load = peers.OPTIONAL_PACKAGES[name]
    try:
        load()
    except Exception as e:  # noqa: BLE001 - a broken install (RuntimeError) is "not here" too
        pytest.skip(f"{package} does not import ({e}); it is in the bench extra")


@pytest.fixture(scope="module")
def bench_tools():
    """The bench and bench-convert commands' modules (tools/bench_loader.py, bench_convert.py)."""
    from shardflow.tools import bench_convert, bench_loader

    return bench_loader, bench_convert


@pytest.fixture(scope="module")
def tiny_corpus(bench_tools, tmp_path_factory):
    """24 photo-like JPEGs in 10 class folders and as shards; batch 8, 2 threads."""
    return bench_tools[0].build_corpus(tmp_path_factory.mktemp("corpus"), 24, 8, 2)


def _folder_samples(folder) -> Counter:
    """(JPEG bytes, ImageFolder label) of every file, as a multiset."""
    from shardflow.tools.bench.image import folder_items

    return Counter((path.read_bytes(), label) for path, label in folder_items(folder))


# litdata.optimize spawns its worker processes: some 10 s on 2 cores.
@pytest.mark.parametrize("name", ["MosaicML Streaming",
                                  pytest.param("LitData", marks=pytest.mark.slow)])
def test_optional_contender_reads_every_image_once_per_epoch(bench_tools, request, name):
    """The contender bench_loader adds: each epoch is every image once, uint8 (N, 3, 224, 224)
    in batches of at most 8, with the ImageFolder labels; the same object, epoch after epoch
    (persistent workers)."""
    _needs(name)
    import torch

    from shardflow.tools.bench.image import folder_items

    c = request.getfixturevalue("tiny_corpus")  # made only where a contender runs
    contender = bench_tools[0].OPTIONAL[name](c)
    assert contender.epoch() == contender.epoch() == c.images == 24
    labels: Counter = Counter()
    for images, batch_labels in contender.loader:
        assert images.dtype == torch.uint8
        assert images.shape[1:] == (3, c.size, c.size) and 1 <= len(images) <= c.batch_size
        assert len(batch_labels) == len(images)
        labels.update(int(label) for label in batch_labels)
    assert labels == Counter(label for _, label in folder_items(c.folder))
    assert contender.epoch() == 24
    del contender  # its persistent workers stop, and the feeder threads of their queues
    gc.collect()


@pytest.mark.slow  # numba compiles FFCV's pipeline, its writer starts processes
def test_ffcv_reads_the_same_jpeg_bytes_each_epoch(tiny_corpus, monkeypatch):
    """FFCV's contender (where ffcv builds: make bench-ffcv): the .beton holds each photo's
    own JPEG bytes, its stored size and label, and an epoch is every photo once, uint8
    (N, 3, 224, 224) with the ImageFolder labels."""
    pytest.importorskip("ffcv")
    import torch
    import tqdm
    from ffcv.fields import RGBImageField
    from ffcv.reader import Reader
    from PIL import Image

    from shardflow.tools.bench.beton import Ffcv
    from shardflow.tools.bench.image import folder_items

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # the writer's bars: no thread
    contender = Ffcv(tiny_corpus)
    assert contender.epoch() == contender.epoch() == 24
    labels: Counter = Counter()
    for images, batch_labels in contender.loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 224, 224)
        labels.update(int(label) for label in batch_labels)
    items = folder_items(tiny_corpus.folder)
    assert labels == Counter(label for _, label in items)
    beton = tiny_corpus.shards.parent / "ffcv.beton"
    stored = Reader(str(beton), {"image": RGBImageField})
    sizes = {int(row["ptr"]): int(row["size"]) for row in stored.alloc_table}
    raw = beton.read_bytes()
    for (image, label), (path, want) in zip(stored.metadata, items, strict=True):
        ptr = int(image["data_ptr"])
        assert raw[ptr:ptr + sizes[ptr]] == path.read_bytes() and label == want
        with Image.open(path) as img:
            assert (int(image["width"]), int(image["height"]), int(image["mode"])) == \
                (*img.size, 0)  # 0: FFCV's "jpg" mode


def test_the_entropy_floor_decodes_every_photo_whole(tiny_corpus, tmp_path):
    """The large-photo floor (every row at 1/8 scale, no loader) is a real decode of every
    photo, each epoch: a photo cut short stops it."""
    import dataclasses

    from shardflow.tools.bench.image import WholeEighthDecode

    floor = WholeEighthDecode(tiny_corpus)
    assert floor.epoch() == floor.epoch() == 24
    cut = tmp_path / "cut"
    shutil.copytree(tiny_corpus.folder, cut)
    victim = sorted(cut.rglob("*.jpg"))[5]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(OSError, match="truncated"):
        WholeEighthDecode(dataclasses.replace(tiny_corpus, folder=cut)).epoch()


@pytest.mark.backend
def test_the_floor_is_a_contender_on_large_photos_only(bench_tools, tiny_corpus,
                                                       monkeypatch):
    """--photos large (and camera) adds the floor beside the loaders."""
    bench_loader = bench_tools[0]
    monkeypatch.setattr(bench_loader, "OPTIONAL", {})  # the peers are tested below
    small = bench_loader.contenders(tiny_corpus, photos="small")
    large = bench_loader.contenders(tiny_corpus, photos="large")
    assert set(large) - set(small) == {bench_loader.FLOOR}
    assert set(bench_loader.contenders(tiny_corpus, photos="camera")) == set(large)
    assert large[bench_loader.FLOOR].epoch() == tiny_corpus.images


def _read_mds(out) -> list[tuple[bytes, int]]:
    from shardflow.tools.bench.peers import streaming_base

    dataset = streaming_base().LocalDataset(local=str(out))
    return [(s["jpg"], int(s["cls"])) for s in (dataset[i] for i in range(len(dataset)))]


def _read_litdata(out) -> list[tuple[bytes, int]]:
    from litdata import StreamingDataset

    return [(s["jpg"], int(s["cls"])) for s in StreamingDataset(input_dir=str(out))]


@pytest.mark.parametrize("name, contender, reader, folder", [
    ("MosaicML Streaming", "MDSWriter (MosaicML Streaming)", _read_mds, "mds"),
    pytest.param("LitData", "litdata.optimize", _read_litdata, "litdata",
                 marks=pytest.mark.slow)])
def test_bench_convert_optional_contenders_write_the_same_bytes(
        bench_tools, request, tmp_path, name, contender, reader, folder):
    """bench_convert's MDSWriter and litdata.optimize runs write every JPEG as it is, with its
    label, once; a second run (the next repeat) replaces the first's output, whole."""
    _needs(name)
    photos = request.getfixturevalue("tiny_corpus").folder
    runs = bench_tools[1].contenders(photos, tmp_path)
    assert {"tar -cf", "make_shards 1 worker", contender} <= set(runs)
    expected = _folder_samples(photos)
    for _ in range(2):
        runs[contender]()
        samples = reader(tmp_path / folder)
        assert len(samples) == 24 and Counter(samples) == expected
    assert {p.name for p in tmp_path.iterdir()} == {folder}, "scratch left beside the output"


@pytest.mark.slow
def test_tune_writes_the_fastest_configuration_for_uint8_and_float(tmp_path):
    """--tune measures every configuration, then where float output is made fastest, and
    writes both; image_loader then picks them up (the figures themselves are the machine's)."""
    from shardflow.loading.tuning import load

    path = tmp_path / "tuning.json"
    proc = run_tool("bench_loader", "--tune", "--images", 16, "--batch-size", 8, "--repeats", 1,
                    "--work", tmp_path / "work", "--tuning-file", path, check=True)
    tuning = load(path)
    assert tuning is not None and tuning.images_per_s > 0
    rows = tuning.table
    assert rows == sorted(rows, key=lambda row: -row["images_per_s"])  # the winner first
    if not dali_importable():
        assert tuning.reader == rows[0]["reader"] and tuning.threads == rows[0]["threads"]
    else:  # resize_on is a choice of the DALI backend only
        assert {row.get("resize_on") for row in rows} == {"torch", "dali", None}
        assert tuning.resize_on == next(r for r in rows if r["backend"] == "dali")["resize_on"]
        assert tuning.resize_on_float in ("torch", "dali")
        assert f"with normalize=True, resize_on={tuning.resize_on_float}" in proc.stdout
        # both backends ran; the file's choices are DALI's, the split holds both fastest
        assert {row["backend"] for row in rows} == {"dali", "portable"}
        assert tuning.reader == next(r for r in rows if r["backend"] == "dali")["reader"]
        fastest = next(r for r in rows if r["backend"] == "portable")
        assert tuning.portable == {"threads": fastest["threads"], "prefetch": fastest["prefetch"]}
        (point,) = tuning.backend_split
        assert 1 < point["side_ratio"] < 3  # built-in photos of 350-500 px, output 224
        assert point["portable"] == max(r["images_per_s"] for r in rows
                                        if r["backend"] == "portable")
        assert "backend='auto' takes the portable backend from" in proc.stdout
    assert not (tmp_path / "work").exists()


@pytest.mark.slow
@pytest.mark.dali
def test_tune_of_one_backend_keeps_what_the_file_said_of_the_other(tmp_path):
    """--tune --backend portable leaves DALI's choices as they were (with no file: automatic,
    never the portable run's stream reader); --backend dali leaves the portable threads."""
    from shardflow.loading.tuning import Tuning, load

    path = tmp_path / "tuning.json"
    split = [{"side_ratio": 13.7, "dali": 60.0, "portable": 130.0}]

    def tune(backend):
        run_tool("bench_loader", "--tune", "--backend", backend, "--images", 16,
                 "--batch-size", 8, "--repeats", 1, "--work", tmp_path / "work",
                 "--tuning-file", path, check=True)
        return load(path)

    Tuning("cpu", "dali", 3, 4, 900.0, resize_on="dali", backend_split=split,
           portable={"threads": 1, "prefetch": 3}).save(path)
    tuned = tune("portable")
    assert (tuned.device, tuned.reader, tuned.threads, tuned.prefetch, tuned.resize_on) == \
        ("cpu", "dali", 3, 4, "dali")
    assert tuned.backend_split == split  # one backend measured: no new point
    measured = tuned.portable
    assert measured["threads"] in (2, 3)  # measured now (the runs' 2 threads, or one more)
    tuned = tune("dali")
    assert tuned.portable == measured and tuned.reader in ("dali", "stream")
    assert {row["backend"] for row in tuned.table} == {"dali"}
    path.unlink()
    tuned = tune("portable")
    assert (tuned.device, tuned.reader) == ("auto", "auto")
    assert tuned.portable == {k: tuned.table[0][k] for k in ("threads", "prefetch")}


@pytest.mark.slow
def test_the_streaming_benchmark_resumes_fetching_only_what_is_left(tmp_path):
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    out = tmp_path / "stream.json"
    run_tool("bench_stream", "--images", 48, "--shard-size", "200KB", "--repeats", 1,
             "--json", out, check=True)
    result = json.loads(out.read_text())
    fetched = result["remote_bytes"]
    assert result["shards"] >= 4 and fetched["cache_second"] == 0
    assert 0 < fetched["resume_at_half"] < fetched["epoch"]


@pytest.mark.slow  # a whole benchmark run (the no-DALI pass of the Makefile leaves it out)
def test_bench_convert_end_to_end(tmp_path):
    """tools/bench_convert.py on 12 photos, 2 repeats: the report's input is the corpus's
    real size, every rate is that size over the median of its timed repeats, tar is the unit,
    the table is printed and written, and the work folder goes."""
    import statistics

    from shardflow.builtin import make_photo_corpus

    out = tmp_path / "out"
    proc = run_tool("bench_convert", "--out", out, "--count", 12, "--repeats", 2, check=True)
    report = json.loads((out / "convert.json").read_text())
    photos = make_photo_corpus(tmp_path / "same-photos", count=12)  # byte-identical
    mb = sum(f.stat().st_size for f in photos.rglob("*") if f.is_file()) / 1e6
    assert (report["files"], report["repeats"]) == (12, 2)
    assert report["input_MB"] == round(mb, 2)
    rows = {r["contender"]: r for r in report["rows"]}
    assert {"tar -cf", "make_shards 1 worker", "make_shards 2 workers"} <= set(rows)
    assert rows["tar -cf"]["vs_tar"] == 1.0
    for row in rows.values():
        assert len(row["seconds"]) == 2 and row["MB_per_s"] > 0 and row["vs_tar"] > 0
        assert row["MB_per_s"] == pytest.approx(mb / statistics.median(row["seconds"]),
                                                rel=0.01, abs=0.01)
    assert (out / "convert.md").read_text().strip() in proc.stdout
    assert {p.name for p in out.iterdir()} == {"convert.json", "convert.md"}
    # Ratios are of the same rounds' pairs; start-up is make_shards' own, as a share of a run.
    seconds = {name: row["seconds"] for name, row in rows.items()}
    two, one = seconds["make_shards 2 workers"], seconds["make_shards 1 worker"]
    assert report["ratios"]["make_shards 2 workers / make_shards 1 worker"] == pytest.approx(
        statistics.median(a / b for a, b in zip(one, two, strict=True)), abs=0.002)
    assert set(report["ratios"]) == {
        "make_shards 2 workers / make_shards 1 worker",
        "make_shards 2 workers / webdataset ShardWriter + PIL check",
        "make_shards 1 worker / webdataset ShardWriter + PIL check"}
    for name in ("make_shards 1 worker", "make_shards 2 workers"):
        row = rows[name]
        assert row["startup_s"] > 0
        assert row["startup_share"] == pytest.approx(
            row["startup_s"] / statistics.median(row["seconds"]), rel=0.01)
    assert "startup_s" not in rows["tar -cf"]


def test_bench_convert_contenders_do_the_whole_work(bench_tools, tiny_corpus, tmp_path):
    """What bench_convert times is the whole conversion, every repeat: plain tar holds every
    photo, make_shards' shards every photo once with its label, also when run again over
    its previous output (the next repeat)."""
    import tarfile

    from conftest import read_wds

    runs = bench_tools[1].contenders(tiny_corpus.folder, tmp_path)
    expected = _folder_samples(tiny_corpus.folder)
    runs["tar -cf"]()
    with tarfile.open(tmp_path / "plain.tar") as tar:
        files = [tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()]
    assert Counter(files) == Counter(data for data, _ in expected.elements())
    for workers in (1, 2):
        for _ in range(2):
            runs[f"make_shards {workers} worker" + ("s" if workers > 1 else "")]()
            samples = read_wds(tmp_path / f"w{workers}")
            assert Counter((s["jpg"], int(s["cls"])) for s in samples) == expected


def test_bench_convert_shardwriter_checks_and_writes_every_photo(bench_tools, tiny_corpus,
                                                                 tmp_path):
    """The ShardWriter contender writes every photo once with its label, over its previous
    output too, and its PIL check is a real decode: a cut JPEG stops it."""
    import webdataset as wds

    runs = bench_tools[1].contenders(tiny_corpus.folder, tmp_path)
    expected = _folder_samples(tiny_corpus.folder)
    for _ in range(2):
        runs["webdataset ShardWriter + PIL check"]()
        urls = [str(p) for p in sorted((tmp_path / "wds").glob("*.tar"))]
        samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
        assert Counter((s["jpg"], int(s["cls"])) for s in samples) == expected
    cut = tmp_path / "cut"
    shutil.copytree(tiny_corpus.folder, cut)
    victim = sorted(cut.rglob("*.jpg"))[3]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(OSError, match="truncated"):
        bench_tools[1].write_shardwriter(cut, tmp_path / "wds-cut")


def test_bench_loader_lidar_frame_figures(tmp_path, monkeypatch, capsys):
    """Per frame: preparation, the step, both serialised and overlapped. Each figure is the
    time this test measures around the same epoch (and the steps within it, each timed
    here too), over the frames: the step epoch runs a step a batch and nothing else, the
    overlapped one a step a batch as the loader hands them over."""
    from shardflow.tools import bench_loader
    from shardflow.tools.bench import lidar

    epochs: list[dict] = []  # each epoch the benchmark times, as timed here
    steps: list[float] = []  # each training step's seconds, timed here
    real_epoch, real_step = lidar.one_epoch, lidar.Step.__call__

    def step(self, batch) -> None:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        real_step(self, batch)
        steps.append(time.perf_counter() - start)

    def one_epoch(source, epoch, step, batches=None):  # type: ignore[no-untyped-def]
        kind = "prepare" if step is None else "step" if batches is not None else "overlapped"
        first, start = len(steps), time.perf_counter()
        seconds, seen = real_epoch(source, epoch, step, batches)
        epochs.append({"kind": kind, "s": time.perf_counter() - start, "steps": steps[first:],
                       "frames": sum(len(b) for b in seen) if kind == "prepare" else None})
        return seconds, seen

    monkeypatch.setattr(lidar, "one_epoch", one_epoch)
    monkeypatch.setattr(lidar.Step, "__call__", step)
    out = tmp_path / "lidar.json"
    assert bench_loader.main(["--modality", "lidar", "--frames", "4", "--repeats", "1",
                              "--batch-size", "2", "--work", str(tmp_path / "work"),
                              "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    t = r["per_frame_ms"]
    # the warm-up, then the repeat's three epochs: 4 frames in 2 batches, a step each
    assert [e["kind"] for e in epochs] == ["overlapped", "prepare", "step", "overlapped"]
    assert [len(e["steps"]) for e in epochs] == [2, 0, 2, 2] and epochs[1]["frames"] == 4
    own = {e["kind"]: e["s"] / 4 * 1000 for e in epochs[1:]}  # ms a frame, timed here
    own["serialised"] = own["prepare"] + own["step"]
    for name, ms in own.items():  # rounded to 0.1 ms; the wrapper adds microseconds
        assert t[name] == pytest.approx(ms, rel=0.01, abs=0.1), (name, t, own)
    for e in epochs[2:]:  # each epoch holds its steps
        assert t[e["kind"]] >= sum(e["steps"]) / 4 * 1000 - 0.1, (t, e)
    assert min(t["prepare"], t["step"]) > 0
    # the same work overlapped: no faster than its slower stage alone
    assert t["overlapped"] >= 0.9 * max(t["prepare"], t["step"])
    assert r["voxelize"]["points_per_s_per_core"] > 0 and r["voxelize"]["frames"] == 2
    assert r["voxelize"]["points"] > 2 * 50_000  # real-size frames
    assert out.with_suffix(".md").read_text().strip() in capsys.readouterr().out
    assert not (tmp_path / "work").exists()


@pytest.mark.backend
def test_bench_loader_captions_pipeline_beside_webdataset_map(tmp_path):
    """The image + caption benchmark: a Pipeline and webdataset's .decode().map() with
    DataLoader workers over the same img2dataset-layout shards, each reading every photo."""
    out = tmp_path / "captions.json"
    proc = run_tool("bench_loader", "--modality", "captions", "--images", 16, "--repeats", 1,
                    "--batch-size", 8, "--work", tmp_path / "work", "--json", out, "--plot",
                    tmp_path / "captions.png", check=True)
    result = json.loads(out.read_text())
    assert set(result["images_per_s"]) == {"shardflow pipeline", "shardflow pipeline portable",
                                           "webdataset .decode().map()"}
    assert all(v > 0 for v in result["images_per_s"].values())
    assert result["vs_webdataset"]["webdataset .decode().map()"] == 1.0
    assert out.with_suffix(".md").read_text().strip() in proc.stdout
    assert (tmp_path / "captions.png").stat().st_size > 1000
    assert not (tmp_path / "work").exists(), "the benchmark's work folder was left behind"


@pytest.mark.parametrize("classes", [2, 3, 1000])
def test_the_recipe_contenders_take_the_class_count_from_the_folder(bench_tools, tmp_path,
                                                                    classes):
    """`bench --source DIR` on a folder of any number of classes: the mixup contenders mix
    into that many (their soft targets' width), on both sides."""
    from conftest import jpeg_bytes

    from shardflow.tools.bench import recipe

    src = tmp_path / "src"
    for c in range(classes):
        (src / f"c{c:04d}").mkdir(parents=True)
        (src / f"c{c:04d}" / "a.jpg").write_bytes(jpeg_bytes(c, size=(32, 24)))
    (src / "c0000" / "b.jpg").write_bytes(jpeg_bytes(5000, size=(32, 24)))  # a full batch
    corpus = bench_tools[0].build_corpus(tmp_path / "work", 0, 2, 1, source=src)
    corpus = type(corpus)(corpus.folder, corpus.shards, corpus.images, 2, 1, size=16)
    ours = recipe.OursRecipe(corpus)
    try:
        batch = next(iter(ours.loader))
        assert batch.target.shape == (2, classes)
    finally:
        ours.loader.close()
    theirs = recipe.TorchvisionRecipe(corpus)
    assert theirs.mix.classes == classes


def test_a_run_too_small_to_time_says_so_and_gives_no_ratio(bench_tools):
    """One batch of 64, or contenders timed for a fraction of a second: the figures would be
    start-up and noise (the tour once printed 'DALI by hand 82,790 images/s')."""
    from pathlib import Path

    from shardflow.tools.bench.core import Timings
    from shardflow.tools.bench.image import Corpus

    loader = bench_tools[0]
    runs = {"shardflow": None, "DALI by hand": None}
    quick = Timings(seconds={"shardflow": [0.05], "DALI by hand": [0.0008]})
    one_batch = Corpus(Path("."), Path("."), 64, 64, 2)
    said = loader.too_small(one_batch, quick, runs)
    assert said is not None and "1 batches of 64" in said and "DALI by hand" in said
    enough = Timings(seconds={"shardflow": [0.6, 0.7, 0.6], "DALI by hand": [0.4, 0.4, 0.5]})
    assert loader.too_small(Corpus(Path("."), Path("."), 800, 64, 2), enough, runs) is None
    table = loader.print_table({
        "images": 64, "batch_size": 64, "threads": 2, "repeats": 1, "torchvision": "v2",
        "backend": "dali", "images_per_s": {"shardflow": 1280.0},
        "ratios": {"shardflow/dali": 0.005},
        "cpu_s_per_image": {"shardflow": 0.001}, "too_small": said,
        "time_to_first_batch_s": 0.2, "overlap": 1.1, "rss_mb_after_each_epoch": [900],
        "peak_rss_mb": 910})
    assert "too small to measure" in table and "| ratio" not in table
