"""image_loader(augment=[...], batch_augment=[...]): the ops run inside the loader, drawn per
sample from (seed, epoch, key), so its batches are the plain loader's batches with
`ops.apply` and the mix run over them, on every backend and reader, and after a resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import gpu_available, resumed_run
from test_ops import Invert  # the own op of docs/ops.md

from shardflow import image_loader, ops

BACKENDS = [pytest.param("dali", "dali", marks=pytest.mark.dali),
            pytest.param("stream", "dali", marks=pytest.mark.dali),
            ("stream", "portable")]


def _recipe() -> list[ops.Op]:
    return [ops.RandAugment(2, 9), ops.ColorJitter(0.4, 0.4, 0.4, 0.1), Invert(0.3)]


def _make(op_shards, reader: str, backend: str, threads: int = 1, **options
          ):  # type: ignore[no-untyped-def]
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    return image_loader(op_shards, batch_size=8, size=32, device="cpu", seed=3, threads=threads,
                        reader=reader, backend=backend, use_tuning=False, **options)


@pytest.mark.parametrize("reader, backend", BACKENDS)
@pytest.mark.backend
def test_the_loaders_ops_are_ops_apply_over_its_plain_batches(op_shards, reader, backend):
    mix = ops.Mix(0.8, 1.0, classes=10, label_smoothing=0.1)
    for epoch in (0, 1):
        with _make(op_shards, reader, backend) as plain:
            plain.set_epoch(epoch)
            want = []
            for batch in plain:
                images = ops.apply(_recipe(), batch.image,
                                   ops.sample_rngs(3, epoch, batch.keys))
                want.append((batch.keys, *mix(images, batch.label,
                                              ops.batch_rng(3, epoch, batch.keys))[:2]))
        # two decode threads: the ops run in the decode stage all the same
        with _make(op_shards, reader, backend, threads=2, augment=_recipe(),
                   batch_augment=[mix]) as aug:
            aug.set_epoch(epoch)
            got = [(b.keys, b.image, b.target) for b in aug]
            where = aug.describe()["augment"]
        assert [k for k, *_ in got] == [k for k, *_ in want] and len(got) == 5
        for (_, a, ta), (_, b, tb) in zip(got, want, strict=True):
            assert a.dtype == torch.uint8 and torch.equal(a, b) and torch.equal(ta, tb)
            assert ta.shape == (8, 10) and torch.allclose(ta.sum(1), torch.ones(8))
    # the ops changed the pixels: RandAugment's two ops reach nearly every image
    with _make(op_shards, reader, backend) as plain:
        plain.set_epoch(1)
        first = next(iter(plain)).image
    assert (got[0][1] != first).flatten(1).any(1).float().mean() > 0.5
    assert [e["op"] for e in where] == [repr(op) for op in _recipe()] + [repr(mix)]
    assert all("CPU, in the decode stage" in e["runs"] for e in where)


class _Where(ops.Op):
    """Leaves the images as they are; records the thread each batch's op ran in."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def draw(self, rng):  # type: ignore[no-untyped-def]
        return None

    def torch(self, images, params):  # type: ignore[no-untyped-def]
        import threading

        self.threads.append(threading.current_thread().name)
        return images


@pytest.mark.parametrize("reader, backend", BACKENDS)
@pytest.mark.backend
def test_a_cpu_loaders_ops_run_beside_its_decode_stage_and_stop_with_it(op_shards, reader,
                                                                        backend):
    """The ops of a CPU loader run in the decode stage's helper threads (while its own
    thread resizes the next batch); a pass left after a batch stops them (the conftest's
    check fails a test that leaves a thread behind), and a whole pass gives that batch
    first, as the ops alone give it."""
    where = _Where()
    with _make(op_shards, reader, backend, augment=[where, ops.RandAugment(2, 9)]) as loader:
        first = next(iter(loader))  # a pass left after one batch
    with _make(op_shards, reader, backend, augment=[where, ops.RandAugment(2, 9)]) as loader:
        batches = list(loader)
    with _make(op_shards, reader, backend) as plain:
        want = next(iter(plain))
    assert len(batches) == 5 and batches[0].keys == first.keys == want.keys
    assert torch.equal(batches[0].image, first.image)
    assert torch.equal(first.image, ops.apply([ops.RandAugment(2, 9)], want.image,
                                              ops.sample_rngs(3, 0, want.keys)))
    assert len(where.threads) >= 6
    assert all(t.startswith("shardflow-image-ops") for t in where.threads)


@pytest.mark.backend
def test_a_cpu_loader_with_ops_prefetches_deeper_unless_told(op_shards):
    """loader.AUGMENT_PREFETCH for a CPU loader with ops and no prefetch given; the default
    without ops, and whatever the user gives."""
    from shardflow.image.loader import AUGMENT_PREFETCH

    ra = [ops.RandAugment(2, 9)]
    with _make(op_shards, "stream", "portable", augment=ra) as deeper, \
            _make(op_shards, "stream", "portable") as plain, \
            _make(op_shards, "stream", "portable", augment=ra, prefetch=1) as told:
        assert (deeper.cfg.prefetch, plain.cfg.prefetch, told.cfg.prefetch) == \
            (AUGMENT_PREFETCH, 2, 1)
        assert len(list(deeper)) == len(list(told)) == 5


@pytest.mark.parametrize("reader, backend", BACKENDS)
@pytest.mark.backend
def test_randaugment_and_mixup_resume_bit_identical(op_shards, reader, backend):
    """State saved after two batches, loaded into a new loader: the same keys, pixels and
    targets as the loader that went on; every sample once in the epoch."""
    def make():  # type: ignore[no-untyped-def]
        return _make(op_shards, reader, backend, augment=_recipe(),
                     batch_augment=ops.MixUp(0.8, classes=10))

    head, rest, again = resumed_run(make)
    assert len(rest) == 3 and [b.keys for b in again] == [b.keys for b in rest]
    for a, b in zip(again, rest, strict=True):
        assert torch.equal(a.image, b.image) and torch.equal(a.target, b.target)
    assert len({k for b in head + rest for k in b.keys}) == 40


@pytest.mark.backend
def test_normalize_and_nhwc_come_after_the_ops(op_shards):
    recipe = [ops.Solarize(128, p=0.5), Invert(0.5)]
    with _make(op_shards, "stream", "portable", augment=recipe) as loader:
        want = next(iter(loader))
    with _make(op_shards, "stream", "portable", augment=recipe, normalize=True) as loader:
        normed = next(iter(loader))
        mean, std = loader.cfg.mean, loader.cfg.std
    with _make(op_shards, "stream", "portable", augment=recipe, layout="NHWC") as loader:
        nhwc = next(iter(loader))
    expect = (want.image.float() - torch.tensor(mean).view(1, 3, 1, 1)) / \
        torch.tensor(std).view(1, 3, 1, 1)
    assert normed.image.dtype == torch.float32 and torch.allclose(normed.image, expect)
    assert nhwc.image.shape == (8, 32, 32, 3) and nhwc.image.is_contiguous()
    assert torch.equal(nhwc.image.permute(0, 3, 1, 2), want.image)


@pytest.mark.backend
def test_a_skipped_sample_leaves_the_others_their_own_draws(tmp_path):
    """A corrupt image skipped (its batch one short): every other sample gets the pixels its
    key draws, as if it were augmented alone."""
    from test_image_loader import _bad_shards, _corrupt_scan

    out = _bad_shards(tmp_path, {"class0_img004.jpg": _corrupt_scan(1)})
    recipe = [ops.TrivialAugmentWide(), Invert(0.5)]
    with image_loader(out, batch_size=4, size=32, device="cpu", seed=3, threads=1,
                      train=False, on_error="skip", backend="portable",
                      use_tuning=False) as plain:
        alone = {k: ops.apply(recipe, b.image[i:i + 1], ops.sample_rngs(3, 0, [k]))
                 for b in plain for i, k in enumerate(b.keys)}
    with image_loader(out, batch_size=4, size=32, device="cpu", seed=3, threads=1,
                      train=False, on_error="skip", backend="portable", use_tuning=False,
                      augment=recipe) as loader:
        batches = list(loader)
        assert loader.skip_counts() == {"bad-image": 1}
    assert sorted(len(b) for b in batches) == [3, 4, 4]
    for b in batches:
        for i, k in enumerate(b.keys):
            assert torch.equal(b.image[i:i + 1], alone[k]), k


def _readme_example() -> str:
    section = (Path(__file__).parents[1] / "docs" / "ops.md").read_text()
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("reader, backend", BACKENDS)
@pytest.mark.backend
def test_the_readmes_own_op_runs_in_the_loader(op_shards, reader, backend, capsys):
    """docs/ops.md's example as written, on our shards (its "shards/train" replaced, and a
    smaller size): its last batch is the plain loader's, augmented by its recipe and mix."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    code = _readme_example()
    assert code.count('"shards/train", ') == 1
    options = {"size": 32, "threads": 1, "device": "cpu", "reader": reader,
               "backend": backend, "use_tuning": False}
    scope = {"SHARDS": op_shards, "OPTIONS": options}
    exec(code.replace('"shards/train", ', "SHARDS, **OPTIONS, "), scope)  # the docs' code
    assert "decode stage" in capsys.readouterr().out
    last, recipe, mix = scope["batch"], scope["recipe"], scope["mix"]
    with image_loader(op_shards, batch_size=64, seed=0, **options) as plain:
        want = list(plain)[-1]
    images = ops.apply(recipe, want.image, ops.sample_rngs(0, 0, want.keys))
    images, target, _ = mix(images, want.label, ops.batch_rng(0, 0, want.keys))
    assert last.keys == want.keys and len(last) == 40
    assert torch.equal(last.image, images) and torch.equal(last.target, target)
    assert torch.allclose(last.target.sum(1), torch.ones(40))


@pytest.mark.backend
def test_ops_the_loader_cannot_run_are_refused(op_shards):
    with pytest.raises(ValueError, match="not a shardflow.ops.Op"):
        _make(op_shards, "stream", "portable", augment=[lambda x: x])
    with pytest.raises(ValueError, match="one ops.Mix at most"):
        _make(op_shards, "stream", "portable",
              batch_augment=[ops.MixUp(classes=10), ops.CutMix(classes=10)])
    with pytest.raises(ValueError, match="classes=7, but the shards hold 10"):
        _make(op_shards, "stream", "portable", batch_augment=[ops.MixUp(classes=7)])
    with pytest.raises(ValueError, match="labels=False"):
        _make(op_shards, "stream", "portable", labels=False,
              batch_augment=[ops.MixUp(classes=10)])


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CUDA (no GPU on this machine)")
def test_a_gpu_loaders_ops_run_on_the_device_and_match_the_cpu(op_shards):
    mix = ops.CutMix(1.0, classes=10)
    with _make(op_shards, "stream", "portable", augment=_recipe(), batch_augment=mix) as cpu:
        want = list(cpu)
    with image_loader(op_shards, batch_size=8, size=32, device="cuda", seed=3, threads=1,
                      reader="stream", backend="portable", use_tuning=False,
                      augment=_recipe(), batch_augment=mix) as gpu:
        got = list(gpu)
        assert "after delivery" in gpu.describe()["augment"][0]["runs"]
    for a, b in zip(got, want, strict=True):
        assert a.image.is_cuda and a.target.is_cuda and a.keys == b.keys
        # colour ops round the same float maths; a level apart at most on another device
        assert (a.image.cpu().int() - b.image.int()).abs().max() <= 1
        assert torch.allclose(a.target.cpu(), b.target)


@pytest.mark.backend
def test_a_gpu_loaders_route_run_on_the_cpu_gives_the_cpu_loaders_batches(op_shards,
                                                                           monkeypatch):
    """The CPU twin of the test above: the route a GPU loader takes (the decode stage hands
    out plain batches, the ops run once each is delivered, in the consumer's thread, with
    the draws of its epoch and keys) taken on the CPU gives the batches of the ops run in the
    decode stage, bit for bit (one device: the same maths)."""
    from shardflow.image import batchops

    mix = ops.CutMix(1.0, classes=10)
    with _make(op_shards, "stream", "portable", augment=_recipe(), batch_augment=mix) as cpu:
        want = [list(cpu), list(cpu)]  # two epochs: the second's draws differ
    monkeypatch.setattr(batchops, "after_delivery", lambda placement: True)
    with _make(op_shards, "stream", "portable", augment=_recipe(), batch_augment=mix) as late:
        assert late._decoder.batch_ops is None  # not in the stage: after delivery
        got = [list(late), list(late)]
    for epoch_got, epoch_want in zip(got, want, strict=True):
        for a, b in zip(epoch_got, epoch_want, strict=True):
            assert a.keys == b.keys and torch.equal(a.image, b.image)
            assert torch.equal(a.target, b.target)


@pytest.mark.parametrize("threads", [1, 6])
@pytest.mark.backend
def test_a_cpu_loader_with_ops_reuses_its_batch_buffers(op_shards, threads):
    """The op helpers hold batch buffers too (up to one more than they run at once): the
    pool counts them, so a second pass writes into the first's buffers, at 6 helpers too."""
    with _make(op_shards, "stream", "portable", threads=threads,
               augment=[ops.RandAugment(2, 9)]) as loader:
        first = [b.keys for b in loader]
        pool = loader._decoder.pool
        before = pool.reused
        again = [b.keys for b in loader]
        assert pool.reused > before and len(pool.buffers) <= pool.slots
        assert pool.slots == 4 + 3 + max(2, threads) + 1  # AUGMENT_PREFETCH 4, the helpers
    assert len(first) == len(again) == 5


def _graph_recipe() -> list[ops.Op]:
    """Ops with a DALI form first (Flip, Brightness, Affine, Rotate, GaussianBlur), then one
    without (Solarize): the graph runs the five, torch the last."""
    return [ops.Flip(0.5), ops.Brightness((0.6, 1.4)),
            ops.Affine(degrees=20, translate=(0.1, 0.1), scale=(0.9, 1.1)), ops.Rotate(15),
            ops.GaussianBlur(5, p=0.5), ops.Solarize(128, 0.5)]


@pytest.mark.dali
@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_ops_with_a_dali_form_run_in_the_graph_as_torch_runs_them(op_shards, reader):
    """resize_on="dali": the graph resizes, so it runs the leading ops that have a DALI form,
    from the draws ops.apply makes; torch runs the rest. Against the same graph's plain
    batches through ops.apply: brightness rounds where torch truncates (a level), and the
    nearest-neighbour warps break exact ties apart now and then."""
    with _make(op_shards, reader, "dali", resize_on="dali", augment=_graph_recipe()) as loader:
        got = {k: b.image[i] for b in loader for i, k in enumerate(b.keys)}
        where = [e["runs"] for e in loader.describe()["augment"]]
    with _make(op_shards, reader, "dali", resize_on="dali") as plain:
        want = {k: ops.apply(_graph_recipe(), b.image[i:i + 1], ops.sample_rngs(3, 0, [k]))[0]
                for b in plain for i, k in enumerate(b.keys)}
    assert where == ["the DALI graph (cpu)"] * 5 + ["torch on the CPU, in the decode stage's "
                                                    "helper threads"]
    assert sorted(got) == sorted(want) and len(got) == 40
    diff = torch.stack([(got[k].int() - want[k].int()).abs() for k in got])
    assert (diff > 1).float().mean() < 1e-3 and diff.float().mean() < 0.6
    assert (diff > 0).float().mean() > 0.05  # brightness's rounding: the graph did run it


@pytest.mark.dali
def test_saturation_runs_in_the_graph_within_two_levels_of_torch(op_shards):
    """Saturation's DALI form (fn.color_twist: the grey unrounded, the blend rounded) gives
    the pixels of its torch form two levels apart at most, from the same draws."""
    recipe = [ops.Saturation((0.2, 1.8))]
    with _make(op_shards, "dali", "dali", resize_on="dali", augment=recipe) as loader:
        got = {k: b.image[i] for b in loader for i, k in enumerate(b.keys)}
        where = [e["runs"] for e in loader.describe()["augment"]]
    with _make(op_shards, "dali", "dali", resize_on="dali") as plain:
        want = {k: ops.apply(recipe, b.image[i:i + 1], ops.sample_rngs(3, 0, [k]))[0]
                for b in plain for i, k in enumerate(b.keys)}
    assert where == ["the DALI graph (cpu)"] and sorted(got) == sorted(want)
    diff = torch.stack([(got[k].int() - want[k].int()).abs() for k in got])
    assert diff.max() <= 2 and diff.float().mean() < 0.6
    assert (diff > 0).float().mean() > 0.05  # the graph's rounding: it did run there


@pytest.mark.dali
def test_graph_ops_resume_bit_identical(op_shards):
    def make():  # type: ignore[no-untyped-def]
        return _make(op_shards, "dali", "dali", resize_on="dali", augment=_graph_recipe(),
                     batch_augment=[ops.CutMix(classes=10)])

    head, rest, again = resumed_run(make)
    assert [b.keys for b in again] == [b.keys for b in rest] and len(rest) == 3
    for a, b in zip(again, rest, strict=True):
        assert torch.equal(a.image, b.image) and torch.equal(a.target, b.target)


@pytest.mark.dali
def test_an_op_without_a_dali_form_keeps_the_rest_in_torch(op_shards):
    """Solarize first: nothing runs in the graph (each op after one that ran in torch runs
    in torch too, so the draws and the pixels keep their order)."""
    recipe = [ops.Solarize(128, 0.5)] + _graph_recipe()[:2]
    with _make(op_shards, "dali", "dali", resize_on="dali", augment=recipe) as loader:
        where = [e["runs"] for e in loader.describe()["augment"]]
    assert not any("DALI" in w for w in where) and len(where) == 3


def killed_loader(shards, reader: str, backend: str, **extra):  # type: ignore[no-untyped-def]
    """The loader tests/loader_killed.py iterates and kills: RandAugment, an own op, mixup
    and cutmix, two decode threads (and `extra` options)."""
    return image_loader(shards, batch_size=8, size=32, device="cpu", seed=5, threads=2,
                        reader=reader, backend=backend, use_tuning=False,
                        augment=[ops.RandAugment(2, 9), Invert(0.3)],
                        batch_augment=[ops.Mix(0.8, 1.0, classes=10)], **extra)


def batch_digest(batch) -> list[str]:  # type: ignore[no-untyped-def]
    """keys, pixels and soft targets of a batch, as digests."""
    import hashlib

    return [",".join(batch.keys), hashlib.sha256(batch.image.numpy().tobytes()).hexdigest(),
            hashlib.sha256(batch.target.numpy().tobytes()).hexdigest()]


@pytest.mark.parametrize("reader, backend", BACKENDS)
@pytest.mark.backend
def test_a_loader_killed_mid_epoch_resumes_with_the_same_augmented_batches(
        op_shards, tmp_path, reader, backend):
    """SIGKILL after the second batch (a child process, tests/loader_killed.py); a new
    loader given the last state it wrote gives the batches the uninterrupted loader gave
    after it: the same keys, pixels and targets, bit for bit."""
    import subprocess
    import sys

    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    with killed_loader(op_shards, reader, backend) as whole:
        want = [batch_digest(b) for b in whole]
    out = tmp_path / "killed.jsonl"
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "loader_killed.py"),
                           str(op_shards), reader, backend, "2", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL, not an exit
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["digest"] for line in lines] == want[:2]
    with killed_loader(op_shards, reader, backend) as resumed:
        resumed.load_state_dict(lines[-1]["state"])
        assert [batch_digest(b) for b in resumed] == want[2:] and len(want) == 5
