"""backend="auto" for images, per dataset: DALI where it imports, except on photos so large
that the portable backend's decode is the faster one: it decodes a JPEG at the largest DCT
scale the crop allows (PIL's draft) and no row below the window (rows.py), where DALI's CPU
decoder decodes every pixel of the window at full scale.

    up to PROBES samples spread over the shards (ShardDataset, raw members, local shards
    with indexes) -> each image's stored size from its header -> the median shorter side
    >= LARGE x size -> "portable" (a window is drafted where it is 4x size or more, to
    leave 2x after the draft: portable.HEADROOM; below that the row cut alone gains)

Measured on 2 cores (tools/bench_loader.py, paired in one run): on 3000-4000 px photos of
about 1 MB (--photos large) the portable backend read 2.2x the images a second of the DALI
backend; on ImageNet-sized photos (350-500 px) DALI stays ahead. The choice is made only
where decoding runs on the CPU: a GPU's nvJPEG decodes whole photos fast (decode="gpu" and
a CUDA device with decode="auto" keep DALI), and only where nothing asked for DALI's own
parts (reader="dali", resize_on="dali").

`bench_loader --tune` measures both backends on the corpus it tunes on and the tuning file
keeps each measurement with that corpus's side ratio (median shorter side / output size);
`split` keeps LARGE while they agree with it and moves the line past any that contradicts it,
so a machine where DALI (more cores) or PIL (a faster libjpeg) wins more often moves it.
`settle_backend` is where image_loader and the trainers' loaders apply all of this.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path
from typing import Any

from shardflow.loading.shardlist import Source

log = logging.getLogger(__name__)

LARGE = 4  # the median shorter side at least this many times the output size
PROBES = 12


def prefers_portable(source: Source, size: int, cfg: Any, large: float = LARGE,
                     whence: str = "the default") -> bool:
    """Whether backend="auto" should run the portable backend on `source` (see above): the
    median shorter side at least `large` times `size` (`whence`: where `large` came from,
    for the log)."""
    if cfg.backend != "auto" or cfg.decode == "gpu" or cfg.reader == "dali" or \
            cfg.resize_on == "dali" or not _decodes_on_cpu(cfg):
        return False
    sides = shorter_sides(source)
    if not sides or statistics.median(sides) < large * size:
        return False
    log.info("backend='auto': the portable backend, as these photos are large (median "
             "shorter side %d px, %.3gx output %d or more, the split of %s: a scaled decode "
             "of the rows the crop needs beats DALI's full one); backend='dali' keeps DALI",
             statistics.median(sides), large, size, whence)
    return True


def split(observations: list[dict[str, float]], default: float = LARGE) -> float:
    """The side ratio from which the portable backend is chosen, from --tune's measurements
    ({"side_ratio", "dali", "portable"}: images/s of each backend's fastest configuration
    decoding on the CPU): `default` wherever it lies between the largest ratio DALI won and
    the smallest above it the portable backend won; where a measurement contradicts it, the
    line moves just past that measurement (halfway, geometrically, to the other side's
    nearest win where there is one)."""
    listed = observations if isinstance(observations, list) else []  # edited by hand?
    points = [{k: float(o[k]) for k in _KEYS} for o in listed if valid(o)]
    dali = [o["side_ratio"] for o in points if o["dali"] >= o["portable"]]
    lo = max(dali, default=0.0)
    portable = [o["side_ratio"] for o in points if o["portable"] > o["dali"] and
                o["side_ratio"] > lo]
    hi = min(portable, default=math.inf)
    if lo < default <= hi:
        return default  # the measurements agree with it
    if lo and hi < math.inf:
        return math.sqrt(lo * hi)
    return lo * math.sqrt(2) if lo >= default else hi / math.sqrt(2)


_KEYS = ("side_ratio", "dali", "portable")


def valid(point: Any) -> bool:
    """A well-formed point (the file may have been edited by hand): positive finite numbers."""
    try:
        return all(0 < float(point[k]) < math.inf for k in _KEYS)
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: 10**400
        return False


def settle_backend(source: Source, asked: dict[str, Any], tuning_file: Path | None,
                   use_tuning: bool, size: int | None = None) -> dict[str, Any]:
    """The image loader's options (image_loader, and the trainers' loaders), with the tuning
    file's choices for the backend that runs (logged once), backend="auto" settled: from the
    options the caller gave (`asked`: a reader or resize_on the tuning file chose for DALI
    does not keep DALI on large photos) and where decoding will run (the tuned `decode`), at
    the tuning file's split. The portable backend gets only the tuned choices it can use, its
    own threads and prefetch. `size`: the output size, where `asked` does not hold it."""
    from shardflow.image.config import ImageConfig
    from shardflow.loading import readers, tuning

    def tuned(dali: bool, say: bool = True) -> dict[str, Any]:
        if not use_tuning:
            return dict(asked)
        return tuning.apply("image", asked, tuning_file, say=say, dali=dali,
                            dali_readable=readers.dali_readable(source))

    backend = asked.get("backend", "auto")
    if backend != "auto" or not readers.dali_importable():
        return tuned(readers.resolve_backend(backend, "image") == "dali")
    first = tuned(True, say=False)  # its decode says where decoding runs
    check: dict[str, Any] = {"batch_size": 1, **asked,
                             "decode": first.get("decode", asked.get("decode", "auto"))}
    if size is not None:
        check["size"] = size
    cfg = ImageConfig(**check)
    large, whence = (tuned_split(tuning_file), "this machine's tuning file") if use_tuning \
        else (LARGE, "the default")
    if not prefers_portable(source, cfg.size, cfg, large, whence):
        return {**tuned(True), "backend": "dali"}
    return {**tuned(False), "backend": "portable"}


def tuned_split(path: Path | None) -> float:
    """The split of this machine's tuning file (`split`), or the measured default, LARGE."""
    from shardflow.loading import tuning

    found = tuning.load(path)
    return split(found.backend_split) if found is not None else LARGE


def side_ratio(source: Source, size: int) -> float | None:
    """The median shorter side of `source`'s photos over `size` (None: not probed)."""
    sides = shorter_sides(source)
    return statistics.median(sides) / size if sides else None


def _decodes_on_cpu(cfg: Any) -> bool:
    if cfg.decode == "cpu" or cfg.device == "cpu":
        return True
    import torch

    return not torch.cuda.is_available()


def shorter_sides(source: Source) -> list[int]:
    """The stored shorter side of up to PROBES images spread over `source` (read from their
    headers); [] where they cannot be read cheaply (remote shards, no indexes, bad data)."""
    from shardflow.access.dataset import ShardDataset
    from shardflow.loading.readers import dali_readable
    from shardflow.samples.checks import IMAGE_EXTS

    # local shards each with a regular .idx: a FIFO in an index's place would block the probe
    if not source.shards or not dali_readable(source):
        return []
    try:
        with ShardDataset([s.url for s in source.shards], decode=False) as dataset:
            count = len(dataset)
            sides = [_shorter_side(dataset, i, IMAGE_EXTS)
                     for i in sorted({k * count // PROBES for k in range(PROBES)})]
            return [side for side in sides if side is not None]
    except Exception as exc:  # noqa: BLE001 - a probe that fails leaves the default choice
        log.debug("backend='auto': could not probe the photos' sizes (%s)", exc)
        return []


def _shorter_side(dataset: Any, i: int, exts: Any) -> int | None:
    """Sample `i`'s stored shorter side; None for a sample that cannot say (a bad one is the
    loader's to report): the other probes still count."""
    from shardflow.samples.headers import read_header

    try:
        sample = dataset.raw(i) or {}
        image = next((v for k, v in sample.items() if k.rsplit(".", 1)[-1].lower() in exts),
                     None)
        if not isinstance(image, bytes):
            return None
        header = read_header(image)  # whole: an ICC profile may take the header past 64 KB
        return min(header.width, header.height)
    except Exception as exc:  # noqa: BLE001 - as above, for this sample alone
        log.debug("backend='auto': sample %d says no size (%s)", i, exc)
        return None
