"""backend="auto" for images, per dataset: DALI where it imports, except on photos so large
that the portable backend's decode is the faster one: it decodes a JPEG at the largest DCT
scale the crop allows (PIL's draft) and no row below the window (rows.py), where DALI's CPU
decoder decodes every pixel of the window at full scale.

    up to PROBES samples spread over the shards (ShardDataset, raw members, local shards
    with indexes) -> each image's stored size from its header -> the median shorter side
    >= LARGE x size (most random crops then take a 1/2 scale or more) -> "portable"

Measured on 2 cores (tools/bench_loader.py, paired in one run): on 3000-4000 px photos of
about 1 MB (--photos large) the portable backend read 2.2x the images a second of the DALI
backend; on ImageNet-sized photos (350-500 px) DALI stays ahead. The choice is made only
where decoding runs on the CPU: a GPU's nvJPEG decodes whole photos fast (decode="gpu" and
a CUDA device with decode="auto" keep DALI), and only where nothing asked for DALI's own
parts (reader="dali", resize_on="dali").

`bench_loader --tune` measures both backends on the corpus it tunes on and the tuning file
keeps each measurement with that corpus's side ratio (median shorter side / output size);
`tuned_split` puts the line between the ratios DALI won and those the portable backend won, so
a machine where DALI (more cores) or PIL (a faster libjpeg) wins more often moves it.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path
from typing import Any

from pipeline.loading.shardlist import Source

log = logging.getLogger(__name__)

LARGE = 4  # the median shorter side at least this many times the output size
PROBES = 12


def prefers_portable(source: Source, size: int, cfg: Any, large: float = LARGE) -> bool:
    """Whether backend="auto" should run the portable backend on `source` (see above): the
    median shorter side at least `large` times `size`."""
    if cfg.backend != "auto" or cfg.decode == "gpu" or cfg.reader == "dali" or \
            cfg.resize_on == "dali" or not _decodes_on_cpu(cfg):
        return False
    sides = shorter_sides(source)
    if not sides or statistics.median(sides) < large * size:
        return False
    log.info("backend='auto': the portable backend, as these photos are large (median "
             "shorter side %d px, %d or more for output %d: a scaled decode of the rows the "
             "crop needs beats DALI's full one); backend='dali' keeps DALI",
             statistics.median(sides), large * size, size)
    return True


def split(observations: list[dict[str, float]], default: float = LARGE) -> float:
    """The side ratio from which the portable backend is chosen, from --tune's measurements
    ({"side_ratio", "dali", "portable"}: images/s of each backend's fastest configuration):
    halfway (geometrically) between the largest ratio DALI won and the smallest above it the
    portable backend won; with wins on one side only, `default` moved past them."""
    dali = [o["side_ratio"] for o in observations if o["dali"] >= o["portable"]]
    portable = [o["side_ratio"] for o in observations if o["portable"] > o["dali"]]
    lo = max(dali, default=None)
    hi = min((r for r in portable if lo is None or r > lo), default=None)
    if lo is not None and hi is not None:
        return math.sqrt(lo * hi)
    if lo is not None:
        return max(default, lo * math.sqrt(2))
    if hi is not None:
        return min(default, hi / math.sqrt(2))
    return default


def tuned_split(path: Path | None) -> float:
    """The split of this machine's tuning file (`split`), or the measured default, LARGE."""
    from pipeline.loading import tuning

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
    from pipeline.access.dataset import ShardDataset
    from pipeline.samples.checks import IMAGE_EXTS
    from pipeline.samples.headers import read_header
    from pipeline.urls import is_remote

    if not source.shards or any(is_remote(s.url) for s in source.shards):
        return []
    try:
        with ShardDataset([s.url for s in source.shards], decode=False) as dataset:
            count = len(dataset)
            sides = []
            for i in sorted({k * count // PROBES for k in range(PROBES)}):
                sample = dataset.raw(i) or {}
                image = next((v for k, v in sample.items()
                              if k.rsplit(".", 1)[-1].lower() in IMAGE_EXTS), None)
                if isinstance(image, bytes):
                    header = read_header(image[:65536])
                    sides.append(min(header.width, header.height))
            return sides
    except Exception as exc:  # noqa: BLE001 - a probe that fails leaves the default choice
        log.debug("backend='auto': could not probe the photos' sizes (%s)", exc)
        return []
