"""The sample stage: a pipeline's fields and per-sample Python, in the reader stage's thread.

    for each sample the reader stage checked (its image header read, its crop window drawn):
      decode each field's member           -> DataError: a named skip (or the error)
      each map / filter, in order, with a random.Random from (seed, epoch, key, stage)
                                           -> None / False: Filtered, counted apart from skips
    then once per batch: each field's encode (the tokenizer's batch call)
    and at delivery: each field's collate  -> tensors where the values stack

Every draw comes from (seed, epoch, key) and the stage's name, never from the batch, the rank,
the reader or the thread: a resumed pipeline, or one on another number of ranks, decides
every sample as the first run did.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from shardflow.compose.fields import PROGRAMMING_ERRORS, Field, name_of
from shardflow.errors import DataError, Filtered
from shardflow.loading.batch import EncodedBatch


class ImageSize(NamedTuple):
    """What a map or filter sees of the image: its upright size (the pixels are decoded after
    the per-sample stages, so that a filter costs no decode)."""

    width: int
    height: int


@dataclass(frozen=True)
class Step:
    """One per-sample Python stage: `map` (sample, rng) -> sample or None, or `filter`
    (sample, rng) -> keep?"""

    kind: Literal["map", "filter"]
    fn: Callable[[dict[str, Any], random.Random], Any]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"{self.kind}({self.fn!r}): a function (sample, rng)")
        if inspect.isgeneratorfunction(self.fn):
            raise ValueError(f"{self.label}: a generator gives several samples for one, and "
                             "the exact and elastic resumes know a sample only by its key; "
                             "return one sample, or None to leave it out")

    @property
    def label(self) -> str:
        return f"{self.kind} {name_of(self.fn)}"


class SampleStage:
    """The fields (name -> member, decoder) and steps of one pipeline, applied by the image
    loader's reader stage to each sample, then to each batch (`encode`)."""

    def __init__(self, fields: dict[str, tuple[str, Field]], steps: tuple[Step, ...],
                 image: str, seed: int, label: str = "") -> None:
        self.fields, self.steps, self.image, self.seed = fields, steps, image, seed
        # The image loader's own label column (an Int field on .cls beside an image): shown
        # to the steps, kept as the loader checked it.
        self.label = label

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(member for member, _ in self.fields.values())

    def check(self, enc: EncodedBatch, i: int, epoch: int, size: tuple[int, int] | None,
              label: int | None = None) -> None:
        """Decode sample i's fields and run the steps over it (the image, if the pipeline has
        one, as its upright `size`; the loader's `label` if it reads one), in place in
        `enc.extras`; DataError for a bad member or a step that refused it, Filtered when
        left out."""
        key = enc.keys[i]
        sample: dict[str, Any] = {"__key__": key, "__url__": enc.urls[i]}
        if self.image and size is not None:
            sample[self.image] = ImageSize(*size)
        if self.label:
            sample[self.label] = label
        for name, (member, field) in self.fields.items():
            sample[name] = _decoded(field, member, enc.extras[member][i])
        for index, step in enumerate(self.steps):
            sample = self._run(step, index, sample, epoch)
        for name, (member, _) in self.fields.items():
            enc.extras[member][i] = sample[name]

    def encode(self, enc: EncodedBatch) -> None:
        """Each field's batch step over what is left of `enc` (in the reader stage)."""
        for member, field in self.fields.values():
            enc.extras[member] = field.encode(enc.extras[member])

    def collate(self, extras: dict[str, list[Any]] | None) -> dict[str, Any]:
        """The batch's fields, as tensors where they stack (at delivery)."""
        extras = extras or {}
        return {name: field.collate(extras.get(member, []))
                for name, (member, field) in self.fields.items()}

    def lengths(self, extras: dict[str, list[Any]] | None) -> dict[str, Any]:
        """Tokens before padding, for each field that pads (Tokens)."""
        extras = extras or {}
        return {name: field.lengths(extras.get(member, []))
                for name, (member, field) in self.fields.items() if hasattr(field, "lengths")}

    def _run(self, step: Step, index: int, sample: dict[str, Any], epoch: int
             ) -> dict[str, Any]:
        key = sample["__key__"]
        rng = random.Random(f"step/{self.seed}/{epoch}/{index}/{key}")
        try:
            out = step.fn(dict(sample), rng)
        except PROGRAMMING_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code refused this sample
            raise DataError("step-error", f"{step.label} raised {type(exc).__name__}: {exc}"
                            ) from None
        if step.kind == "filter":
            if not out:
                raise Filtered(step.label)
            return sample
        if out is None:
            raise Filtered(step.label)
        return self._checked(step, sample, out)

    def _checked(self, step: Step, before: dict[str, Any], out: Any) -> dict[str, Any]:
        """A map's output: a dict of the same sample (its key kept, the image untouched, no
        field added). A different key would break the resumes: they find samples by key."""
        if not isinstance(out, dict):
            raise TypeError(f"{step.label} returned {type(out).__name__}: return the sample "
                            "(a dict), or None to leave it out")
        if out.get("__key__") != before["__key__"]:
            raise ValueError(f"{step.label} changed __key__ ({before['__key__']!r} -> "
                             f"{out.get('__key__')!r}): the exact and elastic resumes find "
                             "samples by key; keep it")
        if self.image and out.get(self.image) is not before[self.image]:
            raise ValueError(f"{step.label} replaced {self.image!r}: the image is decoded "
                             "after the per-sample stages; change it with the Image field's "
                             "augment ops")
        if self.label and out.get(self.label) != before[self.label]:
            raise ValueError(f"{step.label} changed {self.label!r}: the label is the loader's "
                             "own column, read as the shards hold it")
        added = set(out) - set(before)
        if added:
            raise ValueError(f"{step.label} added {sorted(added)}: declare each with "
                             "fields(name=...) so that every batch has it")
        missing = set(before) - set(out)
        if missing:
            raise ValueError(f"{step.label} dropped {sorted(missing)}: every field is in every "
                             "batch; return None to leave the whole sample out")
        return out


def _decoded(field: Field, member: str, data: Any) -> Any:
    if data is None:
        raise DataError("missing-field", f"no .{member} member")
    if len(data) > field.max_bytes:
        raise DataError("member-too-large", f".{member} has {len(data)} bytes, more than "
                        f"max_bytes={field.max_bytes}")
    try:
        return field.decode(data)
    except DataError as err:
        raise DataError(err.reason, f".{member}: {err.detail}") from None
