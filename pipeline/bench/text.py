"""The text loader benchmark: tokens/s through read + check + tokenize + pack + mask with our
loader, against the same tokenizer in plain loops on the same shards, alternated in one run.

Contenders, per tokenizer (the built-in bytes, and a BPE trained on the corpus when HF
tokenizers is installed):
- shardflow: `text_loader(..., objective="mlm")`, one pass, tokens counted from the masks;
- plain loop: the shards read with `tarfile`, each document decoded and tokenized alone, rows
  packed with numpy and masked the same way, in one thread: what a user writes by hand;
- tokenizer alone: `encode_batch` over the documents already in memory, as many a call as the
  loader reads at once (the ceiling for any loader that tokenizes; ours/this is the overhead
  of everything else).
Also reported: tokens per CPU-second of each (the issue's "per CPU thread"), and for ours the
time to first batch, the overlap figure and resident memory per epoch (bench.loader_figures).
"""

from __future__ import annotations

import functools
import statistics
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.bench.core import alternate, cpu_seconds, loader_figures
from pipeline.text import masking, packing
from pipeline.text.config import TextConfig
from pipeline.text.tokenizer import Tokenizer, load_tokenizer, train_bpe

SEQ_LEN = 128


class Ours:
    def __init__(self, shards: Path, tokenizer: Tokenizer, batch_size: int) -> None:
        from pipeline.text.loader import text_loader

        self.loader = text_loader(shards, batch_size=batch_size, seq_len=SEQ_LEN,
                                  objective="mlm", tokenizer=tokenizer, device="cpu")

    def epoch(self) -> int:
        # Counted in numpy, as the plain loop counts: a torch op per batch here cost the
        # loader's epoch about 1.2x more (its stage thread waits for the GIL meanwhile), which
        # would measure the counting, not the loader.
        return sum(int(b.attention_mask.numpy().sum()) for b in self.loader)


class PlainLoop:
    """tarfile -> decode -> tokenize one document at a time -> pack -> mask, one thread."""

    def __init__(self, shards: Path, tokenizer: Tokenizer, batch_size: int) -> None:
        self.paths = sorted(shards.glob("*.tar"))
        self.tok, self.rows = tokenizer, batch_size

    def epoch(self) -> int:
        tok, size = self.tok, self.rows * SEQ_LEN
        buffer: list[np.ndarray] = []
        held, tokens, index = 0, 0, 0
        for path in self.paths:
            with tarfile.open(path) as tar:
                for member in tar:
                    if not member.name.endswith(".txt"):
                        continue
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    doc = tok.encode_batch([data.decode("utf-8")])[0]
                    buffer += [doc, np.array([tok.sep_id], np.int32)]
                    held += len(doc) + 1
                    while held >= size:
                        stream = np.concatenate(buffer)
                        tokens += self._batch(stream[:size], index)
                        buffer, held, index = [stream[size:]], held - size, index + 1
        if held:
            tokens += self._batch(np.concatenate(buffer), index)
        return tokens

    def _batch(self, stream: np.ndarray, index: int) -> int:
        ids, attention = packing.rows(stream, SEQ_LEN, self.tok.pad_id)
        assert self.tok.mask_id is not None
        masking.mlm(ids, attention, masking.batch_rng(0, 0, 0, index), mask_id=self.tok.mask_id,
                    normal_ids=self.tok.normal_ids,
                    special_ids=self.tok.special_ids)
        return int(attention.sum())


class TokenizerAlone:
    """encode_batch over documents already decoded in memory: no reading, packing, masking.
    As many documents a call as the loader's reads hold (HF's encoder runs faster on larger
    calls: 0.91x the time at 256 documents a call as at 64 here), so that the ratio is the
    overhead of the loader's other work."""

    def __init__(self, shards: Path, tokenizer: Tokenizer, batch_size: int) -> None:
        self.tok = tokenizer
        self.batch = TextConfig(batch_size=batch_size, seq_len=SEQ_LEN).read_size()
        self.docs = _documents(shards)

    def epoch(self) -> int:
        count = 0
        for i in range(0, len(self.docs), self.batch):
            count += sum(len(d) + 1 for d in self.tok.encode_batch(self.docs[i: i + self.batch]))
        return count


def _loader(shards: Path, tok: Tokenizer, batch_size: int) -> Any:
    return Ours(shards, tok, batch_size).loader


def tokenizers(work: Path, shards: Path) -> dict[str, Tokenizer]:
    """The built-in bytes, and a 2000-token BPE trained on the corpus when HF tokenizers is
    installed."""
    found: dict[str, Tokenizer] = {"bytes": load_tokenizer("bytes")}
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return found
    path = work / "bpe.json"
    train_bpe(_documents(shards), path, 2000)
    found["bpe-2000"] = load_tokenizer(path)
    return found


def _documents(shards: Path) -> list[str]:
    docs = []
    for path in sorted(shards.glob("*.tar")):
        with tarfile.open(path) as tar:
            docs += [tar.extractfile(m).read().decode("utf-8")  # type: ignore[union-attr]
                     for m in tar if m.name.endswith(".txt")]
    return docs


def run(shards: Path, work: Path, batch_size: int, repeats: int, epochs: int = 4
        ) -> tuple[dict[str, Any], str]:
    """Figures for every tokenizer; returns (JSON-able result, markdown table)."""
    result: dict[str, Any] = {"seq_len": SEQ_LEN, "batch_size": batch_size, "repeats": repeats,
                              "tokenizers": {}}
    for name, tok in tokenizers(work, shards).items():
        runs: dict[str, Any] = {"shardflow": Ours(shards, tok, batch_size),
                "plain loop": PlainLoop(shards, tok, batch_size),
                "tokenizer alone": TokenizerAlone(shards, tok, batch_size)}
        counts = {k: v.epoch() for k, v in runs.items()}  # also the warm-up
        timings = alternate({k: v.epoch for k, v in runs.items()}, repeats=repeats, warmup=0,
                            cpu_clock=cpu_seconds)
        result["tokenizers"][name] = {
            "tokens": counts,  # equal for all: the same work
            "tokens_per_s": {k: round(timings.rate(k, counts[k])) for k in runs},
            "tokens_per_cpu_s": {k: round(counts[k] / max(statistics.median(timings.cpu[k]),
                                                           1e-9)) for k in runs},
            "ratios": {"shardflow/plain loop": round(timings.ratio("shardflow", "plain loop"),
                                                     3),
                       "shardflow/tokenizer alone": round(
                           timings.ratio("shardflow", "tokenizer alone"), 3)},
        }
        runs["shardflow"].loader.close()
        result["tokenizers"][name].update(
            loader_figures(functools.partial(_loader, shards, tok, batch_size), epochs))
    return result, table(result)


def table(r: dict[str, Any]) -> str:
    lines = [f"text: rows of {r['seq_len']} tokens, batch {r['batch_size']}, masking 15%, "
             f"median of {r['repeats']}", "",
             "| tokenizer | loader | tokens/s | tokens per CPU-s |", "|---|---|---|---|"]
    for name, t in r["tokenizers"].items():
        lines += [f"| {name} | {k} | {v} | {t['tokens_per_cpu_s'][k]} |"
                  for k, v in t["tokens_per_s"].items()]
    lines += ["", "| tokenizer | ratio | value |", "|---|---|---|"]
    for name, t in r["tokenizers"].items():
        lines += [f"| {name} | {k} | {v} |" for k, v in t["ratios"].items()]
        lines += [f"| {name} | time to first batch (s) | {t['time_to_first_batch_s']} |",
                  f"| {name} | overlap (1.0 = perfect) | {t['overlap']} |",
                  f"| {name} | RSS after each epoch (MB) | {t['rss_mb_after_each_epoch']} |",
                  f"| {name} | peak RSS (MB) | {t['peak_rss_mb']} |"]
    return "\n".join(lines)
