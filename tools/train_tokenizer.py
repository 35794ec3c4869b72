#!/usr/bin/env python3
"""Train a byte-level BPE tokenizer on the `.txt` documents of shards (needs HF tokenizers:
pip install 'shardflow[text]').

    shardflow train-tokenizer shards/text --out tokenizer.json --vocab-size 8000

The result has the special tokens the text loader looks for ([PAD], [SEP], [MASK]) and
decodes back to the exact text (byte-level: no unknown tokens). Documents that fail the text
checks (bad UTF-8, NUL bytes, empty) are skipped, counted and named, or with
--on-error raise, stop the run naming shard and key.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from shardflow.errors import DataError, OnError, SkipLog, handle
from shardflow.samples.checks import CheckLimits, check_text
from shardflow.tools.util import add_storage_options, positive_int, run_main, setup_logging


def documents(source: str, on_error: OnError, skips: SkipLog, limit: int,
              options: dict[str, Any] | None = None) -> Iterator[str]:
    import fsspec

    from shardflow.loading.shardlist import resolve_source
    from shardflow.shards.tarread import iter_samples
    from shardflow.urls import redact

    checks = CheckLimits(max_text_bytes=limit)
    for shard in resolve_source(source, storage_options=options).shards:
        with fsspec.open(shard.url, "rb", **shard.storage_options) as f:
            for sample in iter_samples(f, redact(shard.url), on_error=on_error, skips=skips):
                if "txt" not in sample:
                    continue
                try:
                    yield check_text(sample["txt"], checks)  # type: ignore[arg-type]
                except DataError as err:
                    handle(err.located(source=str(sample["__url__"]),
                                       key=str(sample["__key__"])), on_error, skips)


def train(source: str, out: Path, vocab_size: int, on_error: OnError, limit: int,
          options: dict[str, Any] | None = None) -> tuple[int, SkipLog]:
    from shardflow.text.tokenizer import train_bpe

    skips, count = SkipLog(), 0

    def counted() -> Iterator[str]:
        nonlocal count
        for doc in documents(source, on_error, skips, limit, options):
            count += 1
            yield doc

    train_bpe(counted(), out, vocab_size)
    return count, skips


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="text shards: a folder with manifest.json, a glob, a URL")
    p.add_argument("--out", type=Path, required=True, help="the tokenizer.json to write")
    p.add_argument("--vocab-size", type=positive_int, default=8000)
    p.add_argument("--on-error", choices=("raise", "skip"), default="skip")
    p.add_argument("--max-doc-bytes", type=positive_int, default=16 * 1024 * 1024)
    p.add_argument("--quiet", action="store_true")
    add_storage_options(p)
    args = p.parse_args(argv)
    setup_logging(args.quiet)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    count, skips = train(args.source, args.out, args.vocab_size, args.on_error,
                         args.max_doc_bytes, args.storage_options)
    if not count:
        raise ValueError(f"{args.source}: no usable .txt documents to train on")
    print(f"{args.out}: BPE tokenizer trained on {count} documents"
          + (f"; skipped {len(skips)}: {skips.counts()}" if len(skips) else ""))
    return 0


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    # ImportError: the optional tokenizers extra
    run_main(lambda: main(argv), usage=(ImportError,))


if __name__ == "__main__":
    entry()
