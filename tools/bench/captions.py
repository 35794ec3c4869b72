"""The image + caption benchmark: a shardflow Pipeline beside the same recipe written with
webdataset's `.decode().map()` and DataLoader workers, on shards in img2dataset's layout.

Same shards for both (`KEY.jpg`, `KEY.txt`, `KEY.json`, written by webdataset's TarWriter from
the built-in photos), same work per sample: random-resized-crop to 224 and a flip (uint8 out),
the caption tokenized by the same tokenizer.json and cut or padded to 77 tokens, the JSON
parsed; same batch size and thread count.
"""

from __future__ import annotations

import glob
import json
import random
from pathlib import Path
from typing import Any

from shardflow.tools.bench import image as bi
from shardflow.tools.bench.core import alternate, cpu_seconds

LENGTH = 77  # CLIP's context
WORDS = ("a photo of the red green small large old new dog cat house tree car street sky "
         "river field city night morning people two three on in with near under over").split()


def write_shards(folder: Path, out: Path, per_shard: int) -> int:
    """The photos of `folder` as img2dataset writes them, with a made-up caption and
    metadata each; indexed for shardflow (webdataset ignores the .idx files)."""
    import webdataset as wds

    from shardflow.shards.indexing import index_folder

    files = [path for path, _ in bi.folder_items(folder)]
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for start in range(0, len(files), per_shard):
        with wds.TarWriter(str(out / f"{start // per_shard:05d}.tar")) as sink:
            for n, path in enumerate(files[start:start + per_shard], start):
                words = rng.choices(WORDS, k=rng.randint(8, 24))
                sink.write({"__key__": f"{n:09d}", "jpg": path.read_bytes(),
                            "txt": " ".join(words).encode(),
                            "json": json.dumps({"url": f"https://example.com/{n}.jpg",
                                                "width": 0, "height": 0}).encode()})
    index_folder(out)
    return len(files)


def train_tokenizer(out: Path) -> Path:
    """A byte-level BPE of the captions' words, for both contenders."""
    from shardflow.text.tokenizer import train_bpe

    train_bpe([" ".join(WORDS)] * 4, out, vocab_size=512)
    return out


class OursPipeline:
    def __init__(self, shards: Path, tokenizer: Path, batch_size: int, threads: int,
                 **options: Any) -> None:
        import shardflow as sf

        pipe = (sf.Pipeline(shards, seed=0, **options)
                .fields(jpg=sf.fields.Image(size=224, train=True, threads=threads,
                                            use_tuning=False),
                        txt=sf.fields.Tokens(tokenizer, length=LENGTH),
                        json=sf.fields.Json())
                .batch(batch_size).to("cpu"))
        self.loader = pipe.loader()

    def epoch(self) -> int:
        return sum(len(b) for b in self.loader)


class _Sample:
    """webdataset's map: the image through the transform, the caption tokenized and padded,
    the JSON parsed (a picklable callable: DataLoader workers take it)."""

    def __init__(self, tokenizer: Path) -> None:
        self.tokenizer, self.tf = str(tokenizer), bi.transform(224, False)[0]
        self.tok: Any = None

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, Any, Any]:
        import torch
        from tokenizers import Tokenizer

        if self.tok is None:  # loaded in each worker
            self.tok = Tokenizer.from_file(self.tokenizer)
        ids = self.tok.encode(sample["txt"], add_special_tokens=False).ids[:LENGTH]
        tokens = torch.full((LENGTH,), 0, dtype=torch.int64)
        tokens[:len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return self.tf(sample["jpg"]), tokens, sample["json"]


class WebdatasetMap:
    """What a user writes with webdataset: decode("pil"), map, batched, DataLoader workers."""

    def __init__(self, shards: Path, tokenizer: Path, batch_size: int, threads: int) -> None:
        import torch
        import webdataset as wds

        urls = sorted(glob.glob(str(shards / "*.tar")))
        dataset = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
                   .shuffle(1000).decode("pil").map(_Sample(tokenizer))
                   .batched(batch_size, collation_fn=_collate))
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=None,
                                                  num_workers=threads, persistent_workers=True)

    def epoch(self) -> int:
        return sum(len(images) for images, _, _ in self.loader)


def _collate(samples: list[tuple[Any, Any, Any]]) -> tuple[Any, Any, list[Any]]:
    import torch

    images, tokens, meta = zip(*samples, strict=True)
    return torch.stack(images), torch.stack(tokens), list(meta)


def run(args: Any) -> tuple[dict[str, Any], str]:
    """Build the corpus, run the contenders alternately, and report rates and ratios."""
    from shardflow.builtin import make_photo_corpus

    folder = make_photo_corpus(args.work / "photos", count=args.images)
    shards = args.work / "captions"
    images = write_shards(folder, shards, per_shard=max(args.images // 8, 1))
    tokenizer = train_tokenizer(args.work / "tokenizer.json")
    common = (shards, tokenizer, args.batch_size, args.threads)
    runs: dict[str, Any] = {"shardflow pipeline": OursPipeline(*common, backend=args.backend),
            "shardflow pipeline portable": OursPipeline(*common, backend="portable"),
            "webdataset .decode().map()": WebdatasetMap(*common)}
    timings = alternate({k: v.epoch for k, v in runs.items()}, repeats=args.repeats,
                        cpu_clock=cpu_seconds, expect=images)
    base = "webdataset .decode().map()"
    result = {"images": images, "batch_size": args.batch_size, "threads": args.threads,
              "repeats": args.repeats,
              "images_per_s": {name: timings.rate(name, images) for name in runs},
              "vs_webdataset": {name: timings.ratio(name, base) for name in runs},
              "seconds": timings.seconds}
    return result, table(result)


def table(r: dict[str, Any]) -> str:
    lines = [f"image + caption + json, {r['images']} photos, batch {r['batch_size']}, "
             f"{r['threads']} threads, medians of {r['repeats']}",
             f"{'contender':<30} {'img/s':>8} {'x webdataset':>13}  each round (s)"]
    for name, rate in r["images_per_s"].items():
        rounds = " ".join(f"{s:.2f}" for s in r["seconds"][name])
        lines.append(f"{name:<30} {rate:>8.0f} {r['vs_webdataset'][name]:>12.2f}x  {rounds}")
    return "\n".join(lines)

