"""Helpers shared by the command-line tools: sizes, parts, storage options, logging, error
exits."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6,
          "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """`64MB` -> 64_000_000 (KB/MB/GB are powers of 1000, KiB/MiB/GiB powers of 1024)."""
    match = _SIZE.match(text)
    unit = (match.group(2) or "").upper() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 64MB, 1GiB, 500000")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return value


def parse_part(text: str) -> tuple[int, int]:
    """`2/8` -> (2, 8): this machine converts slice 2 (0-based) of 8."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if match is None or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise argparse.ArgumentTypeError(f"--part {text!r}: expected i/n with 0 <= i < n, "
                                         "e.g. 0/4 for the first of four machines")
    return int(match.group(1)), int(match.group(2))


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):  # NaN fails `> 0`
        raise argparse.ArgumentTypeError(f"{text}: must be a number of seconds above 0")
    return value


def device_name(text: str) -> str:
    """--device: auto, cpu, cuda, cuda:N (gpu: the older spelling of cuda)."""
    if not re.fullmatch(r"auto|cpu|gpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r}: choose auto, cpu, cuda or cuda:N")
    return text


def storage_option(text: str) -> tuple[list[str], Any]:
    """`--storage-option KEY=VALUE`: the key's path (`client_kwargs.endpoint_url` is
    ["client_kwargs", "endpoint_url"]) and the value, parsed as JSON where it parses (`true`,
    `3`, `{"a": 1}`; `'"123"'` for a string of digits), else the text as given. Messages never
    repeat the value: it may be a secret."""
    key, sep, value = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(part.strip() for part in path):
        raise argparse.ArgumentTypeError("expected KEY=VALUE, e.g. client_kwargs.endpoint_url="
                                         "http://127.0.0.1:9000 or anon=true (a dotted KEY "
                                         "sets a nested option)")
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return [part.strip() for part in path], parsed


def add_storage_options(p: argparse.ArgumentParser, what: str = "shard URLs") -> None:
    """The repeatable `--storage-option KEY=VALUE` flag; `args.storage_options` is then
    fsspec's nested keyword arguments ({} without the flag)."""
    p.add_argument("--storage-option", dest="storage_options", type=storage_option,
                   action=_StorageOptions, default={}, metavar="KEY=VALUE",
                   help=f"an fsspec option for the {what} (s3://, gs://, ...): endpoint, "
                   "profile, anonymous access; repeatable; a dotted KEY nests "
                   "(client_kwargs.endpoint_url=URL), a VALUE that parses as JSON is taken "
                   "as such (anon=true). Never written to a manifest, log or run folder")


def add_timeout(p: argparse.ArgumentParser) -> None:
    """`--timeout SECONDS`: how long a server may keep the command waiting; hand
    `args.timeout` to storage.with_timeouts (or as io_timeout_s)."""
    from shardflow.storage import CONNECT_TIMEOUT_S, READ_TIMEOUT_S

    p.add_argument("--timeout", type=positive_seconds, default=READ_TIMEOUT_S,
                   metavar="SECONDS",
                   help="a server (http(s)://, s3://) that sends nothing for this long, or "
                   f"does not connect within it (at most {CONNECT_TIMEOUT_S:g} s), stops the "
                   "command with exit code 3 and an error naming the URL and the time "
                   f"waited (default {READ_TIMEOUT_S:g}; a timeout in client_kwargs or "
                   "config_kwargs of --storage-option wins)")


class _StorageOptions(argparse.Action):
    """Adds one parsed `--storage-option` to the nested dict; refuses a key given twice, or
    given a value and options beneath it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        path, value = values
        options = copy.deepcopy(getattr(namespace, self.dest, None) or {})
        where = options
        for depth, part in enumerate(path[:-1]):
            where = where.setdefault(part, {})
            if not isinstance(where, dict):
                raise argparse.ArgumentError(self, f"{'.'.join(path)}: "
                                             f"{'.'.join(path[:depth + 1])} already has a value")
        if path[-1] in where:
            raise argparse.ArgumentError(self, f"{'.'.join(path)} is given twice (or also has "
                                         "options beneath it)")
        where[path[-1]] = value
        setattr(namespace, self.dest, options)


def bar_off(quiet: bool) -> bool | None:
    """tqdm's `disable`: off when asked, and (None) off where stderr is no terminal, so that
    logs and CI output get no bar redrawn into them, nor log lines glued onto one."""
    return True if quiet else None


def setup_logging(quiet: bool) -> None:
    logging.basicConfig(level=logging.ERROR if quiet else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def fail(message: str, code: int = 1) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_main(main: Callable[[], int], *, hints: dict[type[BaseException], str] | None = None,
             usage: tuple[type[BaseException], ...] = ()) -> NoReturn:
    """`sys.exit(main())`, with the errors a user can act on turned into one line on stderr
    and an exit code (programming errors keep their traceback):

        1  a data error (DataError: shard, key, reason)
        2  a usage error: a bad option or value, a missing or existing path (and `usage`)
        3  an OS error other than those: a full disk, a permission, a server that could
           not be reached (ConnectionError) or did not answer within --timeout
           (storage.StorageTimeout, a TimeoutError: the URL, what was done, the time waited)
        4  a worker process hung or died (WorkerError)

    `hints`: text added after the message of an error of that type (what to do next)."""
    from shardflow.errors import DataError
    from shardflow.executor import WorkerError

    codes: tuple[tuple[tuple[type[BaseException], ...], int], ...] = (
        ((DataError,), 1), ((WorkerError,), 4),
        ((ValueError, FileNotFoundError, FileExistsError, *usage), 2), ((OSError,), 3))
    try:
        sys.exit(main())
    except tuple(t for types, _ in codes for t in types) as err:
        code = next(c for types, c in codes if isinstance(err, types))
        hint = next((h for t, h in (hints or {}).items() if isinstance(err, t)), "")
        fail(f"{err}{hint}", code)
