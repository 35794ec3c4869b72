"""Where batches land and where they are made: `device` and `decode` resolved once at build
(shardflow.loading.readers.resolve_placement), refused with the option and the fix, exposed by
every loader, and the same choice on train.py's command line; on a GPU, the pinned ring of
the device copier (shardflow.loading.delivery)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

from shardflow.builtin import make_image_folder, make_pointcloud_folder, make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.loading.delivery import DeviceCopier, PinnedRing
from shardflow.loading.readers import Placement, resolve_placement


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees no CUDA device, whatever the machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "gpu"],
                         ids=["cuda", "cuda-1", "old-spelling"])  # an id "gpu" is the marker
def test_a_cuda_device_without_cuda_is_refused_naming_the_option_and_the_fix(no_cuda, device):
    with pytest.raises(ValueError, match=rf"device='{device}' but CUDA is not available.*"
                                         r"device='cpu' or 'auto'"):
        resolve_placement(device, "auto", "image", gpu_decode=True)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_gpu_decoding_needs_batches_on_a_gpu(no_cuda, device):
    with pytest.raises(ValueError, match=r"decode='gpu' puts batches on the GPU: use "
                                         r"device='cuda'.*or decode='cpu'"):
        resolve_placement(device, "gpu", "image", gpu_decode=True)


def test_text_is_never_decoded_on_the_gpu(monkeypatch):
    # CUDA "present" (nothing here touches a device before the refusal)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"decode='gpu': the text loader prepares batches on "
                                         r"the CPU only; use decode='cpu'"):
        resolve_placement("cuda:0", "gpu", "text", gpu_decode=False)


@pytest.mark.parametrize("gpu_decode", [True, False])
def test_auto_without_cuda_is_the_cpu_for_both(no_cuda, gpu_decode):
    for device, decode in (("auto", "auto"), ("cpu", "auto"), ("auto", "cpu"), ("cpu", "cpu")):
        placement = resolve_placement(device, decode, "image", gpu_decode)
        assert placement == Placement("cpu", None, "cpu") and placement.device == "cpu"


def test_cuda_index_and_decode_on_a_machine_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_placement("cuda:1", "auto", "image", True) == Placement("cuda", 1, "gpu")
    assert resolve_placement("auto", "auto", "text", False) == Placement("cuda", 3, "cpu")
    placement = resolve_placement("gpu", "cpu", "pointcloud", True)  # the older spelling
    assert placement == Placement("cuda", 3, "cpu") and placement.device == "cuda:3"


# -- the loaders -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny shards of each modality."""
    root = tmp_path_factory.mktemp("placement")
    folders = {"image": ("imagefolder", make_image_folder(root / "img", per_class=2, size=24)),
               "text": ("text", make_text_corpus(root / "docs", docs=12)),
               "pointcloud": ("pointcloud", make_pointcloud_folder(root / "pc", per_class=2,
                                                                    points=32))}
    for name, (kind, folder) in folders.items():
        convert(ConvertConfig(kind=kind, src=str(folder), out=root / name, max_count=8,
                              workers=1))
    return {name: root / name for name in folders}


def _loader(kind: str, source: Path, **options: object):
    from shardflow import image_loader, pointcloud_loader, text_loader

    make = {"image": image_loader, "text": text_loader, "pointcloud": pointcloud_loader}[kind]
    threads = {} if kind == "text" else {"threads": 1}  # text has no decode threads
    return make(source, batch_size=4, use_tuning=False, **threads, **options)


@pytest.mark.parametrize("kind", ["image", "text", "pointcloud"])
def test_loaders_say_where_they_decode_and_deliver(no_cuda, sources, kind):
    with _loader(kind, sources[kind], device="auto", decode="auto") as loader:
        assert (loader.device, loader.decode) == ("cpu", "cpu")
        batch = next(iter(loader))
    tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    with pytest.raises(ValueError, match="CUDA is not available"):
        _loader(kind, sources[kind], device="cuda")
    with pytest.raises(ValueError, match="decode='gpu'"):
        _loader(kind, sources[kind], device="cpu", decode="gpu")


@pytest.mark.dali
@pytest.mark.parametrize("kind", ["image", "pointcloud"])
@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_a_graph_that_decodes_on_the_cpu_opens_no_cuda_device(monkeypatch, kind, decode):
    """Batches bound for cuda:3: the graph takes device_id=3 only when it decodes there; a
    CPU-decoding graph is built with device_id=None (the copier moves its batches), so DALI
    opens no CUDA context and holds no device memory of its own."""
    from shardflow import dali
    from shardflow.image.config import ImageConfig
    from shardflow.image.decode import DecodeStage
    from shardflow.pointcloud.config import PointCloudConfig
    from shardflow.pointcloud.decode import DecodeStage as CloudDecodeStage

    built: list[object] = []
    monkeypatch.setattr(dali, "build", lambda graph, **options: built.append(
        options["device_id"]))
    placement = Placement("cuda", 3, decode)  # type: ignore[arg-type]
    if kind == "image":
        stage = DecodeStage(ImageConfig(batch_size=4, threads=1), placement, None)
    else:
        stage = CloudDecodeStage(PointCloudConfig(batch_size=4, threads=1), placement)
    stage._build(1)
    assert built == [3 if decode == "gpu" else None]


# -- train.py ---------------------------------------------------------------------------------

def _train(sources: dict[str, Path], tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU for the tool, on any machine
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "train.py"), "--task", "image", "--data",
         str(sources["image"]), "--out", str(tmp_path / "run"), "--steps", "1", "--quiet",
         *args], capture_output=True, text=True, timeout=300, env=env)


def test_train_tool_refuses_cuda_where_there_is_none(sources, tmp_path):
    proc = _train(sources, tmp_path, "--device", "cuda")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "device='cuda' but CUDA is not available here; use device='cpu'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("bad", [["--device", "bogus"], ["--device", "cuda:x"],
                                 ["--decode", "tpu"]])
def test_train_tool_refuses_an_unknown_device_or_decode(sources, tmp_path, bad):
    proc = _train(sources, tmp_path, *bad)
    assert proc.returncode == 2 and bad[0] in proc.stderr and f"'{bad[1]}'" in proc.stderr
    assert "usage:" in proc.stderr  # argparse's refusal, before anything is built


# -- the device copier -------------------------------------------------------------------------

def test_the_copier_on_the_cpu_hands_batches_over_as_they_are():
    copier = DeviceCopier("cpu", None, None, channels_first=True)
    image = np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)
    (moved, nothing), ready = copier.move(image, None)
    assert ready is None and nothing is None
    assert moved.data_ptr() == image.ctypes.data  # a view: no copy on the CPU
    normalizing = DeviceCopier("cpu", (1.0, 2.0, 3.0), (2.0, 2.0, 4.0), channels_first=False)
    out, label, ready = normalizing(image.transpose(0, 2, 3, 1), np.zeros(2, dtype=np.int64))
    expected = (torch.from_numpy(image).permute(0, 2, 3, 1).float()
                - torch.tensor([1.0, 2.0, 3.0])) / torch.tensor([2.0, 2.0, 4.0])
    assert ready is None and torch.equal(out, expected) and label.dtype == torch.int64


@pytest.mark.gpu
def test_the_pinned_ring_never_refills_a_buffer_a_copy_still_reads():
    """50 random batches of changing sizes through a 2-slot ring while the copy stream runs
    far behind (a GPU spin first) and the consumer reads nothing until all are queued: each
    batch, after waiting on its ready event, equals the host tensors it was made from."""
    copier = DeviceCopier("cuda", None, None, channels_first=True, slots=2)
    assert copier.slots == 2
    g = torch.Generator().manual_seed(0)
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(50_000_000)  # ~tens of ms: every copy below queues behind it
    sent, delivered = [], []
    for _ in range(50):
        n = int(torch.randint(1, 9, (1,), generator=g))
        image = torch.randint(0, 256, (n, 3, 16, 16), dtype=torch.uint8, generator=g)
        label = torch.randint(0, 1000, (n,), generator=g)
        sent.append((image.clone(), label.clone()))
        delivered.append(copier(image, label))
    current = torch.cuda.current_stream()
    for (image, label), (on_device, on_device_label, ready) in zip(sent, delivered,
                                                                   strict=True):
        current.wait_event(ready)
        assert on_device.is_cuda and on_device.device.index == torch.cuda.current_device()
        assert torch.equal(on_device.cpu(), image) and torch.equal(on_device_label.cpu(), label)


class LaggingStream:
    """A copy stream on the CPU that runs far behind, as the GPU test's stalled one: a copy is
    only queued, and runs when an event recorded after it is waited on (or at the end)."""

    def __init__(self) -> None:
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0

    def copy(self, source: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(source)
        self.queued.append((out, source))  # reads `source` later: the pinned buffer itself
        return out

    def record(self) -> LaggingEvent:
        return LaggingEvent(self, len(self.queued))

    def run_until(self, n: int) -> None:
        for out, source in self.queued[self.done:n]:
            out.copy_(source)
        self.done = max(self.done, n)


class LaggingEvent:
    def __init__(self, stream: LaggingStream, after: int) -> None:
        self.stream, self.after = stream, after

    def synchronize(self) -> None:
        self.stream.run_until(self.after)


def test_the_pinned_ring_waits_for_a_buffers_copy_before_refilling_it(monkeypatch):
    """The CPU twin of the test above: 50 random batches of changing sizes through 2-slot
    rings (image, label) whose copies run only when the ring waits for them (no pinned
    memory here: plain buffers); each copy, run as late as the ring allows, still reads the
    batch it was queued for."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    rings, stream = (PinnedRing(2), PinnedRing(2)), LaggingStream()
    g = torch.Generator().manual_seed(0)
    sent, delivered = [], []
    for _ in range(50):
        n = int(torch.randint(1, 9, (1,), generator=g))
        batch = (torch.randint(0, 256, (n, 3, 16, 16), dtype=torch.uint8, generator=g),
                 torch.randint(0, 1000, (n,), generator=g))
        sent.append(tuple(t.clone() for t in batch))
        delivered.append([stream.copy(ring.stage(t)) for ring, t in zip(rings, batch,
                                                                          strict=True)])
        ready = stream.record()
        for ring in rings:
            ring.release(ready)
    assert stream.done < len(stream.queued)  # the copies did run behind
    stream.run_until(len(stream.queued))
    for want, got in zip(sent, delivered, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
