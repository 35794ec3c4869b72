"""Data errors and the skip log: how bad input is reported under `raise` and `skip`.

A data error is a problem with the input (a truncated JPEG, a missing label), never a bug in
our code: TypeError, AttributeError and ImportError are never turned into one. Under
`on_error="raise"` the first data error stops the job with the source and key; under
`on_error="skip"` it is counted by reason and named in the log, so `read + skipped == total`.

Each error also says how many samples it cost (`samples`): one for a bad sample; for a shard
lost whole or in part, the samples it still held when its count is known (from manifest.json),
else None (unknown). The skip log sums them, so a run can state `read + skipped == total` in
samples, not only in skip entries.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from shardflow.urls import redact

log = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]
ON_ERROR_CHOICES = ("raise", "skip")


class _Unset:
    pass


_ONE_IF_KEYED = _Unset()


class DataError(Exception):
    """Bad input: `reason` is a short code ("truncated", "bad-utf8"...), `source` the file or
    shard URL (credentials redacted), `key` the sample key when there is one, and `samples`
    how many samples it costs (default: one with a key, unknown without: a whole file)."""

    def __init__(self, reason: str, message: str, *, source: str = "", key: str = "",
                 samples: int | None | _Unset = _ONE_IF_KEYED) -> None:
        self.reason = reason
        self.detail = message
        self.source = redact(source)
        self.key = key
        self._counted = not isinstance(samples, _Unset)  # samples given, not defaulted
        self.samples = samples if not isinstance(samples, _Unset) else (1 if key else None)
        super().__init__(self._text())

    def _text(self) -> str:
        where = self.source + (f" key {self.key!r}" if self.key else "")
        text = f"{self.detail} [{self.reason}]"
        return f"{where}: {text}" if where else text

    def __reduce__(self) -> tuple[object, tuple[str, str, str, str, int | None | _Unset]]:
        # Worker processes send DataErrors to the parent: keep every field across pickling.
        return _rebuild, (self.reason, self.detail, self.source, self.key,
                          self.samples if self._counted else _ONE_IF_KEYED)

    def located(self, *, source: str = "", key: str = "") -> DataError:
        """The same error with the source/key filled in where they were unknown (a count
        left to the default follows the key: one sample once it has one)."""
        return DataError(self.reason, self.detail, source=self.source or source,
                         key=self.key or key,
                         samples=self.samples if self._counted else _ONE_IF_KEYED)


def _rebuild(reason: str, detail: str, source: str, key: str, samples: int | None | _Unset
             ) -> DataError:
    return DataError(reason, detail, source=source, key=key, samples=samples)


def check_on_error(value: str) -> OnError:
    if value not in ON_ERROR_CHOICES:
        raise ValueError(f"on_error={value!r}: choose 'raise' (stop at the first bad sample) or "
                         "'skip' (count, name and drop bad samples)")
    return value  # type: ignore[return-value]


class Filtered(Exception):  # noqa: N818 - a signal, not an error
    """A pipeline's `filter` (or a `map` returning None) left this sample out: not bad data,
    counted apart from skips (SkipLog.filtered) by the stage that did it."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage

    def entry(self, source: str, key: str) -> dict[str, Any]:
        """The marker that travels with its batch to the skip log (committed when the batch is
        handed out, as skips are); counted there, not kept."""
        return {"filtered": self.stage, "source": source, "key": key, "reason": "filtered",
                "detail": f"left out by {self.stage}", "samples": 0}


@dataclass
class SkipLog:
    """Every skipped input, by reason. Kept whole: a run must be able to name all it dropped.
    Samples a pipeline's filter left out are counted by stage (`filtered`), not kept: they
    are no loss, and a filter may leave out most of a dataset."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    announce: bool = True  # log each entry as it comes (off where the caller prints a report)
    filtered: Counter[str] = field(default_factory=Counter)

    def add(self, err: DataError) -> None:
        self.entries.append({"source": err.source, "key": err.key, "reason": err.reason,
                             "detail": err.detail, "samples": err.samples})
        if self.announce:
            log.warning("skipped %s", err)

    def extend(self, entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            if "filtered" in entry:
                self.filtered[entry["filtered"]] += 1
            else:
                self.entries.append(entry)

    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(e["reason"] for e in self.entries).items()))

    def samples(self) -> int:
        """Samples skipped, over the entries whose size is known (see `unknown_size`)."""
        return sum(n for e in self.entries if (n := entry_samples(e)) is not None)

    def unknown_size(self) -> int:
        """Entries whose size is unknown: whole shards (or their rest) without a count."""
        return sum(entry_samples(e) is None for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def entry_samples(entry: dict[str, Any]) -> int | None:
    """Samples a skip entry stands for (entries saved before the count existed: one if keyed)."""
    if "samples" in entry:
        return None if entry["samples"] is None else int(entry["samples"])
    return 1 if entry.get("key") else None


def handle(err: DataError, policy: OnError, skips: SkipLog) -> None:
    """Apply the policy to one data error: re-raise it, or record it as a skip."""
    if policy == "raise":
        raise err
    skips.add(err)

