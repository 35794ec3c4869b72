"""Field decoders: what a pipeline makes of each member of a sample.

    sf.Pipeline("shards/laion").fields(
        jpg=sf.fields.Image(size=224),              # the DALI graph or the portable threads
        txt=sf.fields.Tokens("tokenizer.json", length=77),
        json=sf.fields.Json(),
        npz=sf.fields.Decoder(read_radar))           # bytes -> value, the user's own

A field's name is the member it reads (its extension) unless `member=` says otherwise; the
batch holds it under the name. Each non-image field works in three steps, each where it is
cheap:

    decode(bytes) -> value      one sample, in the reader stage's thread; DataError = bad sample
    encode(values) -> values    one batch of them, same thread (the tokenizer's batch call)
    collate(values) -> batch    at delivery: a tensor when the values stack, else a list

`Image` and `Mask` are not decoded here: the image loader's stages decode them (the crop
window, DALI or PIL, the ops), and a mask goes through every geometric op of its image.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardflow.errors import DataError
from shardflow.samples.checks import check_label, json_of, utf8_of

# Exceptions a user's decoder raises for a bug, not for bad bytes: never turned into a skip.
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, ImportError, AssertionError)
MAX_MEMBER_BYTES = 1 << 24  # 16 MiB: a member larger than this is a data error (`max_bytes`)


@dataclass(frozen=True)
class Image:
    """The sample's image (any of jpg, jpeg, png, webp, ... in either case), decoded and
    augmented by the image loader: every `image_loader` option except the pipeline's own
    (source, batch size, seed, device, on_error), e.g. `Image(size=160, augment=[...])`."""

    options: dict[str, Any] = field(default_factory=dict)

    def __init__(self, **options: Any) -> None:
        for name in ("extras", "targets", "labels", "batch_size", "seed", "device"):
            if name in options:
                raise ValueError(f"Image({name}=...): a pipeline says this with its own "
                                 "fields and methods (fields(), batch(), to())")
        object.__setattr__(self, "options", options)

    def describe(self) -> dict[str, Any]:
        return {"field": "Image", **dict(sorted(self.options.items()))}


@dataclass(frozen=True)
class Mask:
    """A label map (PNG, 8 or 16 bit) of the image's stored size, cropped, resized (nearest)
    and warped by every geometric op with its image: batch[name] is (N, size, size)."""

    member: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"field": "Mask"}


@dataclass(frozen=True)
class Depth:
    """A map of continuous values (depth, a height field) of the image's stored size: a 2-D
    `.npy` or a grey PNG (8 or 16 bit). Cropped, resized and warped with its image, but
    bilinearly: batch[name] is float32 (N, size, size), 0 where a warp leaves the image."""

    member: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"field": "Depth"}


@dataclass(frozen=True, kw_only=True)
class Field:
    """A non-image field: `decode` one member's bytes, `encode` a batch, `collate` at delivery.
    Subclasses override what they need; the defaults pass values through. Every field takes
    `member=` (the member it reads, if not its name) and `max_bytes=` (larger is a bad
    sample), by keyword."""

    member: str | None = None
    max_bytes: int = MAX_MEMBER_BYTES

    def decode(self, data: bytes) -> Any:
        return data

    def encode(self, values: list[Any]) -> list[Any]:
        return values

    def collate(self, values: list[Any]) -> Any:
        return values

    def describe(self) -> dict[str, Any]:
        return {"field": type(self).__name__}


@dataclass(frozen=True)
class Bytes(Field):
    """The member's bytes as they are."""

    def decode(self, data: bytes) -> bytes:
        return bytes(data)


@dataclass(frozen=True)
class Text(Field):
    """UTF-8 text (strict: invalid bytes or a NUL are a bad sample) -> str."""

    def decode(self, data: bytes) -> str:
        return utf8_of(data)


@dataclass(frozen=True)
class Json(Field):
    """JSON -> the parsed object, by json.loads only: nothing in the data is evaluated."""

    def decode(self, data: bytes) -> Any:
        return json_of(data)


@dataclass(frozen=True)
class Int(Field):
    """An ASCII decimal integer (a `.cls` label) -> int64 (N,), within [0, num_classes)."""

    num_classes: int | None = None
    max_bytes: int = field(default=64, kw_only=True)

    def decode(self, data: bytes) -> int:
        return check_label(bytes(data), self.num_classes)

    def collate(self, values: list[Any]) -> Any:
        import torch

        return torch.tensor(values, dtype=torch.int64)


@dataclass(frozen=True)
class Array(Field):
    """`.npy` -> numpy array, `.npz` -> {name: array}; never unpickled (allow_pickle=False).
    Arrays of one shape and dtype stack into a tensor (N, ...); others stay a list."""

    def decode(self, data: bytes) -> Any:
        try:
            loaded = np.load(io.BytesIO(bytes(data)), allow_pickle=False)
            if isinstance(loaded, np.lib.npyio.NpzFile):
                with loaded:
                    return {name: loaded[name] for name in loaded.files}
            return loaded
        except ValueError as exc:  # also "Object arrays cannot be loaded when allow_pickle=False"
            raise DataError("bad-array", f"not a numpy array: {exc}") from None
        except (OSError, EOFError, KeyError) as exc:
            raise DataError("bad-array", f"not a numpy file: {exc}") from None

    def collate(self, values: list[Any]) -> Any:
        return stacked(values)


@dataclass(frozen=True)
class Tokens(Field):
    """UTF-8 text tokenized in the reader stage (one batch call) and cut or padded to `length`:
    batch[name] is int64 (N, length), batch.lengths[name] the tokens before padding.
    `tokenizer`: "bytes", a tokenizer.json path, or a tokenizer object (text/tokenizer.py)."""

    tokenizer: Any = "bytes"
    length: int = 77
    _loaded: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"Tokens(length={self.length!r}): a positive number of tokens")
        from shardflow.text.tokenizer import load_tokenizer

        self._loaded.append(load_tokenizer(self.tokenizer))  # a bad path fails at build

    def decode(self, data: bytes) -> str:
        return utf8_of(data)

    def encode(self, values: list[Any]) -> list[Any]:
        tok = self._loaded[0]
        ids = tok.encode_batch(values) if values else []
        out = []
        for row in ids:
            cut = np.full(self.length, tok.pad_id, dtype=np.int64)
            n = min(len(row), self.length)
            cut[:n] = row[:n]
            out.append((cut, n))
        return out

    def collate(self, values: list[Any]) -> Any:
        import torch

        if not values:
            return torch.zeros((0, self.length), dtype=torch.int64)
        return torch.from_numpy(np.stack([ids for ids, _ in values]))

    def lengths(self, values: list[Any]) -> Any:
        import torch

        return torch.tensor([n for _, n in values], dtype=torch.int64)

    def describe(self) -> dict[str, Any]:
        return {"field": "Tokens", "tokenizer": self._loaded[0].describe(),
                "length": self.length}


@dataclass(frozen=True)
class Decoder(Field):
    """The user's own: `fn(bytes) -> value`, run in the reader stage's thread. What it raises
    (but a TypeError, AttributeError, NameError, ImportError or AssertionError: a bug) is that
    sample's bad-member skip, or the error under on_error="raise", naming shard and key.
    `collate(values)`: how a batch of values is handed over (default: stacked when they stack)."""

    fn: Callable[[bytes], Any] = bytes
    collate_fn: Callable[[list[Any]], Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"Decoder({self.fn!r}): a function from bytes to a value")

    def decode(self, data: bytes) -> Any:
        try:
            return self.fn(bytes(data))
        except PROGRAMMING_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's decoder refused the bytes
            raise DataError("bad-member", f"{name_of(self.fn)} raised {type(exc).__name__}: "
                            f"{exc}") from None

    def collate(self, values: list[Any]) -> Any:
        return self.collate_fn(values) if self.collate_fn is not None else stacked(values)

    def describe(self) -> dict[str, Any]:
        return {"field": "Decoder", "fn": name_of(self.fn)}


def stacked(values: Sequence[Any]) -> Any:
    """A tensor (N, ...) when every value is a numeric numpy array (or number) of one shape and
    dtype; else the list as it is."""
    import torch

    arrays = [np.asarray(v) for v in values] if all(
        isinstance(v, (np.ndarray, int, float, np.number)) and not isinstance(v, bool)
        for v in values) else None
    if not arrays or len({(a.shape, a.dtype) for a in arrays}) != 1 or \
            arrays[0].dtype.kind not in "iufb":
        return list(values)
    return torch.from_numpy(np.stack(arrays))


def name_of(fn: Any) -> str:
    """A function's name as stage labels and saved states carry it: the same in every process
    (never a repr with an address): `trim`, `partial(trim)`, or a callable object's class."""
    if isinstance(fn, functools.partial):
        return f"partial({name_of(fn.func)})"
    return getattr(fn, "__name__", None) or type(fn).__name__
