"""The output folder of a conversion: refuse, clean or resume it, and the journal.

The journal (`.make_shards.journal.json`) records the finished shards and the position in the
task list after each one, so running the same command again after a kill continues where it
stopped; a finished job is marked by its manifest, written last. The folder may be an object
store prefix (pipeline/storage.py): the journal lives there too, so a rerun resumes anywhere.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from shardflow.convert.config import ConvertConfig
from shardflow.shards.listing import list_shards
from shardflow.storage import Store
from shardflow.urls import is_remote

log = logging.getLogger(__name__)
JOURNAL = ".make_shards.journal.json"


@dataclass
class Journal:
    """Progress of an unfinished job: shards done and where in the task list they end."""

    args: dict[str, object]
    shards: list[dict[str, object]] = field(default_factory=list)
    position: list[int] = field(default_factory=lambda: [0, 0])  # [task, result within task]
    skipped: list[dict[str, str]] = field(default_factory=list)
    # What the finished shards hold, for the manifest: image repairs per reason, clouds
    # stored with an offset, the labels as ranges. A journal written before these were
    # recorded lacks them: labels None then means unknown (see _Job).
    reencoded: dict[str, int] = field(default_factory=dict)
    offset_clouds: int = 0
    labels: list[list[int]] | None = None
    rows: int = 0  # tabular rows in the finished shards
    scans: dict[str, Any] | None = None  # scans' points per class (shards/segstats.py)

    def save(self, out: Store) -> None:
        out.write_bytes(JOURNAL, json.dumps(asdict(self)).encode())

    @classmethod
    def load(cls, out: Store) -> Journal:
        return cls(**json.loads(out.read_bytes(JOURNAL)))


def prepare_out(cfg: ConvertConfig, out: Store) -> Journal:
    """Refuse, clean or resume the output folder; returns the journal to continue from."""
    out.makedirs()
    for tmp in out.names(".*.tmp"):
        out.delete(tmp)  # leftovers of a killed run: never under a final name, safe to drop
    if cfg.overwrite:
        _clean(out, cfg)
    elif out.exists(cfg.manifest_name):
        raise FileExistsError(f"{out} already holds a finished conversion ({cfg.manifest_name});"
                              " pass --overwrite to replace it")
    elif out.exists(JOURNAL):
        return _resume(out, cfg)
    elif foreign := _foreign_shards(out, cfg):
        raise FileExistsError(f"{out} already holds shards ({foreign[0]} and "
                              f"{len(foreign) - 1} more); pass --overwrite to replace them")
    return Journal(cfg.job_args(), labels=[])


def _resume(out: Store, cfg: ConvertConfig) -> Journal:
    journal = Journal.load(out)
    if not _same_job(journal, cfg):
        raise FileExistsError(f"{out} holds an unfinished conversion made with other arguments;"
                              " rerun that command to finish it, or pass --overwrite")
    for name in _owned(out, cfg):
        if name not in {str(s["name"]) for s in journal.shards} | {
                str(s["name"])[:-4] + ".idx" for s in journal.shards}:
            out.delete(name)  # renamed after the journal's last save: it will be written again
    log.info("resuming %s after %d finished shards", out, len(journal.shards))
    return journal


def _same_job(journal: Journal, cfg: ConvertConfig) -> bool:
    """Same arguments; the error policy may differ while nothing was skipped yet, since the
    finished shards are then the same under either policy (raise, then rerun with skip)."""
    mine, theirs = cfg.job_args(), dict(journal.args)
    if not journal.skipped:
        mine.pop("on_error")
        theirs.pop("on_error", None)
    return mine == theirs


def _owned(out: Store, cfg: ConvertConfig) -> list[str]:
    pattern = f"{cfg.stem}-[0-9]*"
    return sorted(out.names(pattern + ".tar") + out.names(pattern + ".idx"))


def _foreign_shards(out: Store, cfg: ConvertConfig) -> list[str]:
    # Sibling parts of the same job may share the folder (one per machine).
    sibling = f"{cfg.prefix}-p" if cfg.part[1] > 1 else None
    return [name for name in out.names("*.tar")
            if not (sibling and name.startswith(sibling) and not name.startswith(cfg.stem))]


def _clean(out: Store, cfg: ConvertConfig) -> None:
    doomed = _owned(out, cfg) + _foreign_shards(out, cfg) + [JOURNAL, cfg.manifest_name]
    if cfg.part[1] == 1:
        doomed += out.names("*.idx") + out.names("manifest*.json")
    for name in doomed:
        out.delete(name)


def not_in_place(cfg: ConvertConfig) -> None:
    """Refuse to write into the folder being read: --overwrite would delete the source."""
    if cfg.kind != "shards" or ("://" in cfg.src) != is_remote(cfg.out):
        return
    out = cfg.store()
    if any(out.holds(url) for url in list_shards(cfg.src, cfg.storage_options)):
        raise ValueError(f"{out} holds the source shards; write the new shards to another "
                         "folder")
