"""`Pipeline`: a loader built from stages you can see, for samples of any shape.

    import shardflow as sf
    p = (sf.Pipeline("shards/laion", seed=0, on_error="skip")
           .fields(jpg=sf.fields.Image(size=224, train=True),
                   txt=sf.fields.Tokens("tokenizer.json", length=77),
                   json=sf.fields.Json())
           .filter(lambda sample, rng: sample["jpg"].width >= 64)
           .batch(256)
           .to("cpu"))
    with p.loader() as loader:
        for batch in loader:
            batch["jpg"], batch["txt"], batch["json"], batch.keys

The stages, in the order a sample meets them:

    source       shards, globs, URLs, mixtures; the epoch plan split over ranks (loading/)
    members      the ones the fields name; a sample without one is a named skip
    fields       each member decoded (fields.py): the image by the DALI graph or the portable
                 threads, the rest in the reader stage's thread
    map, filter  the user's Python per sample, with a random.Random from (seed, epoch, key)
    encode       each field's batch step (the tokenizer's batch call), in the same thread
    image ops    crop, resize, flip, `augment`, `batch_augment`, with masks warped alike
    delivery     prefetch queues, the pinned copy, the device; `collate` stacks the fields

Its loader keeps every guarantee of the image loader it is built on: exact resume, elastic
resume on another number of ranks, named and counted skips, mixtures, subsets, holdout. A
pipeline without an image field runs on fieldloader.FieldLoader, with the same guarantees
(mixtures aside).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import IterableDataset

from shardflow.compose.fields import Depth, Field, Image, Int, Mask
from shardflow.compose.samples import SampleStage, Step
from shardflow.errors import OnError, check_on_error

STATE_VERSION = 1


@dataclass(frozen=True)
class Pipeline:
    """A description of a loader; each method returns a new Pipeline. `options`: the loader
    options of `image_loader` that are not about the image (backend, decode, reader,
    prefetch, shuffle_buffer, holdout, subsample, cache_dir, timeout_s, ...)."""

    source: Any
    seed: int = 0
    on_error: OnError = "raise"
    options: dict[str, Any] = field(default_factory=dict)
    named: tuple[tuple[str, Any], ...] = ()
    steps: tuple[Step, ...] = ()
    batch_size: int | None = None
    device: str = "auto"

    def __init__(self, source: Any, *, seed: int = 0, on_error: OnError = "raise",
                 **options: Any) -> None:
        for name, value in (("source", source), ("seed", seed),
                            ("on_error", check_on_error(on_error)), ("options", options),
                            ("named", ()), ("steps", ()), ("batch_size", None),
                            ("device", "auto")):
            object.__setattr__(self, name, value)

    # -- stages ----------------------------------------------------------------------------

    def fields(self, **fields: Image | Mask | Depth | Field) -> Pipeline:
        """The sample's fields by name: at most one `Image`; `Mask`s and `Depth`s warped
        with it; any other `Field` (Tokens, Json, Text, Int, Array, Bytes, Decoder). Without
        an image, the first field's member is the one every sample must have."""
        images = [name for name, f in fields.items() if isinstance(f, Image)]
        if len(images) > 1:
            raise ValueError(f"fields({', '.join(fields)}): one sf.fields.Image field at most "
                             f"(found {len(images)}: {', '.join(images)})")
        spatial = [name for name, f in fields.items() if isinstance(f, (Mask, Depth))]
        if spatial and not images:
            raise ValueError(f"fields({', '.join(fields)}): {', '.join(spatial)} warp with an "
                             "image; add an sf.fields.Image field")
        if not fields:
            raise ValueError("fields(): name at least one field")
        for name, f in fields.items():
            if not isinstance(f, (Image, Mask, Depth, Field)):
                raise TypeError(f"fields({name}={f!r}): an sf.fields decoder, or "
                                "sf.fields.Decoder(fn) for a function of your own")
        return self._with(named=tuple(fields.items()))

    def map(self, fn: Callable[[dict[str, Any], Any], dict[str, Any] | None]) -> Pipeline:
        """`fn(sample, rng) -> sample or None` on each sample after its fields are decoded
        (the image as its size: ImageSize); None leaves the sample out, counted as filtered."""
        return self._with(steps=self.steps + (Step("map", fn),))

    def filter(self, fn: Callable[[dict[str, Any], Any], bool]) -> Pipeline:
        """Keep the samples `fn(sample, rng)` is true for; the rest count as filtered."""
        return self._with(steps=self.steps + (Step("filter", fn),))

    def batch(self, size: int) -> Pipeline:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"batch({size!r}): a positive number of samples")
        return self._with(batch_size=size)

    def to(self, device: str) -> Pipeline:
        """Where batches land: "cpu", "cuda", "cuda:N" or "auto"."""
        return self._with(device=device)

    # -- building ----------------------------------------------------------------------------

    def loader(self, *, rank: int | None = None, world_size: int | None = None,
               **runtime: Any) -> PipelineLoader:
        """The loader this pipeline describes (rank and world size default to
        torch.distributed's); `runtime`: further image_loader arguments, e.g.
        local_world_size."""
        from shardflow.image.loader import image_loader

        if not self.named:
            raise ValueError("a pipeline without fields: call .fields(jpg=sf.fields.Image(), "
                             "...) before .loader()")
        if self.batch_size is None:
            raise ValueError("a pipeline without a batch size: call .batch(n) before .loader()")
        stage, image_name, label, masks = self._stages()
        if not image_name:
            return PipelineLoader(self, self._field_loader(stage, rank, world_size), stage,
                                  "", None, [])
        image = dict(self.named)[image_name]
        extras = stage.members
        inner = image_loader(
            self.source, batch_size=self.batch_size, seed=self.seed, device=self.device,
            on_error=self.on_error, rank=rank, world_size=world_size,
            **{**self.options, **image.options, **runtime}, labels=label is not None,
            extras=extras, targets={n: m for n, m in masks} or None, fields=stage,
            value_targets=tuple(n for n, f in self.named if isinstance(f, Depth)),
            **({"num_classes": label[1].num_classes} if label and label[1].num_classes
               else {}))
        return PipelineLoader(self, inner, stage, image_name, label, masks)

    def _field_loader(self, stage: SampleStage, rank: int | None, world_size: int | None
                      ) -> Any:
        """The loader of a pipeline without an image (fieldloader.py)."""
        from shardflow.compose.fieldloader import FieldLoader
        from shardflow.loading import mix, readers, tuning
        from shardflow.loading.options import LoaderOptions

        if mix.is_mixture(self.source):
            raise ValueError("a mixture of sources needs an sf.fields.Image field in this "
                             "version; read each source with its own pipeline")
        options = {"seed": self.seed, "on_error": self.on_error, "device": self.device,
                   **self.options}
        source, options = tuning.source_and_options("samples", self.source, options, None,
                                                    False)
        assert self.batch_size is not None  # loader() checked
        cfg = LoaderOptions(batch_size=self.batch_size, **options)
        rank, world_size = readers.distributed(rank, world_size)
        first = stage.members[0]
        return FieldLoader(source, cfg, stage, first, rank, world_size)

    def signature(self) -> dict[str, Any]:
        """What a saved state must match: the fields and steps, by name and kind."""
        return {"fields": {name: _plain_describe(f) for name, f in self.named},
                "steps": [step.label for step in self.steps]}

    def _stages(self) -> tuple[SampleStage, str, tuple[str, Any] | None,
                               list[tuple[str, str]]]:
        """(the sample stage, the image's name, the label field (name, Int) read as the
        loader's label when its member is .cls, the masks as (name, member))."""
        image_name, label = "", None
        decoded: dict[str, tuple[str, Field]] = {}
        masks: list[tuple[str, str]] = []
        has_image = any(isinstance(f, Image) for _, f in self.named)
        members: dict[str, str] = {}
        for name, f in self.named:
            member = getattr(f, "member", None) or name
            if not isinstance(f, Image):
                if member in members:
                    raise ValueError(f"fields {members[member]} and {name} both read .{member}: "
                                     "one field a member")
                members[member] = name
            if isinstance(f, Image):
                image_name = name
            elif isinstance(f, (Mask, Depth)):
                masks.append((name, member))
            elif isinstance(f, Int) and member == "cls" and has_image:
                label = (name, f)  # the image loader's own label column
            else:
                decoded[name] = (member, f)
        stage = SampleStage(decoded, self.steps, image_name, self.seed,
                            label=label[0] if label else "")
        return stage, image_name, label, masks

    def _with(self, **changes: Any) -> Pipeline:
        new = copy.copy(self)  # not dataclasses.replace: __init__ takes the user's arguments
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        return new


@dataclass
class SampleBatch:
    """One batch of a pipeline: `batch[name]` for each field (a tensor where the values stack,
    else a list), `keys` (the samples' keys), `lengths[name]` (tokens before padding), and
    `target` (soft targets of batch_augment) and `views` as the image loader gives them."""

    fields: dict[str, Any]
    keys: list[str]
    lengths: dict[str, Any]
    target: Any = None
    views: list[Any] | None = None

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def __len__(self) -> int:
        return len(self.keys)


class PipelineLoader(IterableDataset):  # type: ignore[type-arg]
    """The Loader API over a pipeline: iteration (each pass one epoch), `len`, `state_dict`,
    `skip_counts`, `filtered_counts`, `describe()`; a context manager."""

    def __init__(self, pipeline: Pipeline, inner: Any, stage: SampleStage, image: str,
                 label: tuple[str, Any] | None, masks: list[tuple[str, str]]) -> None:
        self.pipeline, self.inner, self.stage = pipeline, inner, stage
        self.image, self.label, self.masks = image, label, masks

    def __iter__(self) -> Any:
        for batch in self.inner:
            yield self._batch(batch)

    def _batch(self, batch: Any) -> SampleBatch:
        import torch

        if not self.image:  # fieldloader.FieldsBatch: the fields alone
            return self._fields(batch, {}, torch.device(self.inner.device), None, None)
        fields = {self.image: batch.image}
        if self.label is not None:
            fields[self.label[0]] = batch.label
        for name, _ in self.masks:
            fields[name] = batch.targets[name]
        return self._fields(batch, fields, batch.image.device, batch.target, batch.views)

    def _fields(self, batch: Any, fields: dict[str, Any], device: Any, target: Any,
                views: Any) -> SampleBatch:
        """The batch's decoded fields collated and on `device`, beside `fields`."""
        def moved(value: Any) -> Any:
            return value.to(device, non_blocking=True) \
                if hasattr(value, "to") and device.type != "cpu" else value

        fields.update({name: moved(v) for name, v in self.stage.collate(batch.extras).items()})
        lengths = {name: moved(v) for name, v in self.stage.lengths(batch.extras).items()}
        return SampleBatch(fields, batch.keys, lengths, target, views)

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def epoch(self) -> int:
        return int(self.inner.epoch)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def describe(self) -> list[dict[str, Any]]:
        """The stages in order, each with where it runs."""
        inner = self.inner.describe()
        graph = (f"the DALI graph ({inner['decode']})" if inner["backend"] == "dali"
                 else "the portable backend's threads")
        reader_thread = "the reader stage's thread"
        stages = [{"stage": "source", "runs": f"the {inner['reader']} reader",
                   "source": str(self.pipeline.source)}]
        for name, f in self.pipeline.named:
            where = graph if isinstance(f, Image) else \
                "with the image (cut in the reader stage, warped by its ops)" \
                if isinstance(f, (Mask, Depth)) else reader_thread
            stages.append({"stage": f"field {name}", "runs": where, **_plain_describe(f)})
        stages += [{"stage": step.label, "runs": reader_thread}
                   for step in self.pipeline.steps]
        stages += [{"stage": f"op {op['op']}", "runs": op.get("runs", "")}
                   for op in inner["augment"]]
        stages.append({"stage": f"batch {self.pipeline.batch_size}",
                       "runs": f"delivery to {inner['device']}"})
        return stages

    def state_dict(self, gather: bool = True) -> dict[str, Any]:
        return {"version": STATE_VERSION, "kind": "pipeline",
                "pipeline": self.pipeline.signature(),
                "loader": self.inner.state_dict(gather=gather)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a pipeline's, with the same fields and steps); ValueError
        naming what differs."""
        if state.get("kind") != "pipeline":
            raise ValueError(f"this state was saved by a {state.get('kind', 'unknown')!r} "
                             "loader, not a pipeline: resume it with the loader that saved it")
        if int(state.get("version", 0)) != STATE_VERSION:
            raise ValueError(f"pipeline state version {state.get('version')!r}; this shardflow "
                             f"reads version {STATE_VERSION}")
        mine = self.pipeline.signature()
        for part in ("fields", "steps"):
            if state["pipeline"].get(part) != mine[part]:
                raise ValueError(f"pipeline state does not match this pipeline; its {part} "
                                 f"differ: {state['pipeline'].get(part)!r} in the state, "
                                 f"{mine[part]!r} here")
        self.inner.load_state_dict(state["loader"])

    def skip_counts(self) -> dict[str, int]:
        return dict(self.inner.skip_counts())

    def filtered_counts(self) -> dict[str, int]:
        return dict(self.inner.filtered_counts())

    @property
    def skipped(self) -> list[dict[str, Any]]:
        return list(self.inner.skipped)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> PipelineLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain_describe(f: Any) -> dict[str, Any]:
    """A field's description in plain JSON values (an op's class name for an object), so
    that a saved state compares equal in another process."""
    return {k: _plain(v) for k, v in f.describe().items()} | \
        ({"member": f.member} if getattr(f, "member", None) else {})


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return type(value).__name__
