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
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from pipeline.loading.shardlist import Source

log = logging.getLogger(__name__)

LARGE = 4  # the median shorter side at least this many times the output size
PROBES = 12


def prefers_portable(source: Source, size: int, cfg: Any) -> bool:
    """Whether backend="auto" should run the portable backend on `source` (see above)."""
    if cfg.backend != "auto" or cfg.decode == "gpu" or cfg.reader == "dali" or \
            cfg.resize_on == "dali" or not _decodes_on_cpu(cfg):
        return False
    sides = shorter_sides(source)
    if not sides or statistics.median(sides) < LARGE * size:
        return False
    log.info("backend='auto': the portable backend, as these photos are large (median "
             "shorter side %d px, %d or more for output %d: a scaled decode of the rows the "
             "crop needs beats DALI's full one); backend='dali' keeps DALI",
             statistics.median(sides), LARGE * size, size)
    return True


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
