#!/usr/bin/env python3
"""Convert a dataset to WebDataset tar shards with DALI index files and a manifest.

    shardflow convert imagefolder data/train shards/train --max-size 64MB
    shardflow convert text corpus/ shards/text --split-lines
    shardflow convert shards 'old/train-{000000..000099}.tar' shards/new
    shardflow convert parquet 'hf/data/train-*.parquet' shards/train --image-column img
    shardflow convert tabular day_0.gz shards/criteo --preset criteo
    shardflow convert tabular train.csv shards/t --label-column click \
        --dense-columns price --categorical-columns site,device
    shardflow convert imagefolder SRC OUT --part 0/4   # one of four machines
    shardflow convert merge OUT                       # after all parts
    shardflow convert imagefolder SRC OUT --engine ray --ray-address auto  # on Ray
    shardflow convert imagefolder SRC s3://bucket/train \
        --storage-option client_kwargs.endpoint_url=https://objects.example.org

OUT may be an fsspec URL (s3://, gs://, memory://...): each shard and .idx is written whole
locally, uploaded under a hidden temporary key, then moved to its final name; the journal
lives there too (a rerun resumes), the manifest comes last.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import NoReturn

from tqdm import tqdm

from shardflow.convert import ConvertConfig, convert
from shardflow.convert.parquet import ParquetOptions
from shardflow.convert.sources import TextOptions
from shardflow.convert.tabular import PRESETS, TabularOptions, options_from_schema_file
from shardflow.errors import DataError
from shardflow.executor import WorkerError
from shardflow.samples.checks import CheckLimits
from shardflow.samples.downsize import OUTCOMES, Downsize
from shardflow.samples.scans import ScanOptions, with_learning_map
from shardflow.shards.manifest import Manifest, load_manifest, merge_parts
from shardflow.storage import timed, with_timeouts
from shardflow.tools.util import (
    add_storage_options,
    add_timeout,
    bar_off,
    parse_part,
    parse_size,
    positive_int,
    positive_seconds,
    run_main,
    setup_logging,
)
from shardflow.urls import redact


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    helps = {"imagefolder": "one subfolder per class of images (ImageNet layout)",
             "manifest": "a CSV or JSONL file of path[,label]",
             "text": ".txt files (one document each, or one per line) or JSONL",
             "pointcloud": "one subfolder per class of .npy/.ply/.off/.xyz/.bin files, or "
                           "LiDAR scenes (--layout scans|kitti): labelled per point, or "
                           "unlabelled where no scan has labels",
             "shards": "existing tar shards (folder, glob, brace pattern or URL)",
             "parquet": "a Parquet file, a folder of them, or a quoted glob pattern "
                        "(one split of a Hugging Face dataset: 'data/train-*.parquet')",
             "tabular": "CSV/TSV (gzip or not) or Parquet tables: a file, folder or quoted "
                        "glob; rows packed in blocks (click logs: --preset criteo|avazu)"}
    for kind, text in helps.items():
        p = sub.add_parser(kind, help=text)
        p.add_argument("src", help="the source: " + text)
        p.add_argument("out", help="output folder for the shards, or an fsspec URL prefix "
                       "(s3://bucket/train)")
        _common_options(p)
        _kind_options(p, kind)
    index = sub.add_parser("index", help="write DALI indexes and manifest.json for existing "
                           "shards, without rewriting them (made by webdataset, tar or another "
                           "tool): beside them, or in --out DIR")
    index.add_argument("src", help="the folder of .tar shards; with --out, also a read-only "
                       "folder, a glob, a brace pattern or a URL (https://, s3://)")
    index.add_argument("--out", default=None, metavar="DIR",
                       help="a local folder for the .idx files and manifest.json, when they "
                       "cannot lie beside the shards; the loaders then take index=DIR, "
                       "verify_shards --index DIR")
    add_storage_options(index)
    add_timeout(index)
    index.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                       help="raise: stop at the first shard the readers would not read as it "
                       "is; skip: list it in the manifest's skipped and go on")
    index.add_argument("--max-member-size", type=parse_size, default=256 * 2**20,
                       metavar="BYTES", help="refuse members larger than this (default 256MB)")
    index.add_argument("--quiet", action="store_true", help="no progress bar or warnings")
    merge = sub.add_parser("merge", help="combine the manifests of --part runs")
    merge.add_argument("out", help="the folder (or URL prefix) holding every part's shards")
    add_storage_options(merge, "folder's URL")
    return parser


IMAGE_KINDS = ("imagefolder", "manifest", "shards", "parquet")
POINT_KINDS = ("pointcloud", "manifest", "shards")


def _common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", default="train", help="shard names: PREFIX-000000.tar")
    p.add_argument("--max-count", type=positive_int, default=10_000,
                   help="samples per shard (default 10000)")
    p.add_argument("--max-size", type=parse_size, default=parse_size("512MB"),
                   help="bytes per shard, e.g. 64MB or 1GiB (default 512MB)")
    p.add_argument("--shuffle-seed", type=int, default=None,
                   help="spread inputs randomly (but reproducibly) across shards")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="processes that read and check inputs, for an image folder this "
                        "one included (default: all cores)")
    p.add_argument("--worker-timeout", type=positive_seconds, default=900.0, metavar="SECONDS",
                   help="a worker with no result this long is hung: stop with an error naming "
                        "its inputs (default 900; with --workers 1 work runs inline, untimed)")
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: worker processes on this machine; ray: Ray tasks on a cluster "
                   "(--ray-address) or on a local Ray of --workers CPUs; the shards are the "
                   "same bytes either way (pip install 'shardflow[ray]')")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --engine ray: the cluster to run on (host:6379, ray://host:10001, "
                   "or auto: the one this machine belongs to)")
    p.add_argument("--part", type=parse_part, default=(0, 1), metavar="I/N",
                   help="convert only slice I (0-based) of N; merge the parts afterwards")
    p.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="raise: stop at the first bad input; skip: record it and go on")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in OUT")
    p.add_argument("--allow-empty", action="store_true",
                   help="write the manifest of a run that converts no sample (e.g. a --part "
                   "slice with no input); without it such a run exits 2 naming what it passed "
                   "over and skipped, and writes no manifest")
    p.add_argument("--quiet", action="store_true", help="no progress bar or warnings")
    add_storage_options(p, "URLs of OUT and of a shards source")
    add_timeout(p)


def _kind_options(p: argparse.ArgumentParser, kind: str) -> None:
    if kind in IMAGE_KINDS:
        p.add_argument("--max-pixels", type=positive_int, default=CheckLimits.max_pixels,
                       help="refuse images declaring more pixels, before decoding them")
        p.add_argument("--max-side", type=positive_int, default=None, metavar="N",
                       help="store images whose longer side is above N turned upright and "
                       "resized to N, as JPEG (PNG where they have transparency or 16 bits); "
                       "a sample with a mask or a second image keeps them as they are")
        p.add_argument("--jpeg-quality", type=positive_int, default=90, metavar="Q",
                       help="with --max-side: the JPEG quality of what is re-encoded (90)")
        p.add_argument("--reencode-all", action="store_true",
                       help="with --max-side: re-encode the images within N too")
    if kind in POINT_KINDS:
        p.add_argument("--max-points", type=positive_int, default=CheckLimits.max_points,
                       help="refuse point clouds with more points")
    if kind in ("text", "shards", "parquet"):
        p.add_argument("--max-text-bytes", type=parse_size, default=CheckLimits.max_text_bytes,
                       help="refuse documents (or lines) longer than this (default 16MiB)")
    if kind not in ("shards", "parquet", "tabular"):
        p.add_argument("--max-file-size", type=parse_size, default=parse_size("1GiB"),
                       help="refuse input files larger than this (default 1GiB)")
    if kind in ("imagefolder", "pointcloud", "manifest", "parquet"):
        p.add_argument("--classes-from", default=None, metavar="MANIFEST",
                       help="number classes as in this earlier manifest.json (e.g. the "
                       "training split's), so that splits agree")
    if kind == "pointcloud":
        _scan_options(p)
    if kind == "manifest":
        p.add_argument("--path-column", default="path", help="CSV column / JSON field of paths")
        p.add_argument("--label-column", default="label",
                       help="CSV column / JSON field of labels (names or integers; optional)")
        p.add_argument("--mask-column", default=None, metavar="COLUMN",
                       help="CSV column / JSON field of each image's segmentation mask (a "
                       "lossless label map of the image's size), stored as KEY.seg.png")
    if kind in ("text", "shards"):
        p.add_argument("--tokenizer", default=None, metavar="bytes|PATH",
                       help="store each document's token ids (KEY.tokens.u16, or .u32 for "
                       "vocabularies over 65536) instead of its text: 'bytes' or a "
                       "tokenizer.json; text_loader then reads ids, with that tokenizer only")
    if kind == "text":
        p.add_argument("--split-lines", action="store_true", help="one document per line")
        p.add_argument("--text-field", default="text", help="JSONL field holding the text")
    if kind == "parquet":
        _parquet_options(p)
    if kind == "tabular":
        _tabular_options(p)
    if kind == "shards":
        p.add_argument("--max-member-size", type=parse_size, default=parse_size("256MiB"),
                       help="refuse tar members declaring more bytes than this")


def _scan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=("classes", "scans", "kitti"), default="classes",
                   help="classes: one subfolder per class (a label per cloud); scans: every "
                   ".bin/.npy/.ply/.xyz/.off under SRC is a scene labelled per point (its "
                   "--label-column, or a <stem>.label beside it); kitti: SemanticKITTI, "
                   "sequences/NN/velodyne/*.bin with labels/*.label. Scans of which none has "
                   "labels are stored as clouds without any (pointcloud_loader labels=False)")
    p.add_argument("--point-dims", type=int, choices=range(3, 65), default=4, metavar="N",
                   help=".bin clouds and scans: float32 values per point (KITTI 4: x y z "
                   "remission; nuScenes 5)")
    p.add_argument("--label-column", dest="scan_label", default=None, metavar="NAME|INDEX",
                   help="scans: the per-point label column, by PLY property name or by "
                   "index (negative from the end); taken out of the stored points")
    p.add_argument("--learning-map", default=None, metavar="YAML",
                   help="scans: map raw classes to training classes with a SemanticKITTI "
                   "config (learning_map; labels and learning_map_inv name the classes)")
    p.add_argument("--ignore-label", type=int, default=None, metavar="CLASS",
                   help="scans: the class of unlabelled points (default 0 with "
                   "--learning-map, as SemanticKITTI; none otherwise)")


def _scan(args: argparse.Namespace) -> ScanOptions:
    if args.kind != "pointcloud":
        return ScanOptions()
    opts = ScanOptions(args.layout, args.point_dims, args.scan_label,
                       ignore_label=args.ignore_label)
    return with_learning_map(opts, args.learning_map) if args.learning_map else opts


def _parquet_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image-column", default=None, metavar="COLUMN",
                   help="column of image bytes, or of {bytes, path} structs (Hugging Face "
                   "Image); stored as .jpg/.png by the image's real format")
    p.add_argument("--text-column", default=None, metavar="COLUMN",
                   help="column of text: the document (.txt), or with --image-column the "
                   "image's caption")
    p.add_argument("--label-column", dest="parquet_label", default=None, metavar="COLUMN",
                   help="column of labels (.cls): integers kept; strings numbered in sorted "
                   "order (the map goes to manifest.json's classes)")
    p.add_argument("--key-column", default=None, metavar="COLUMN",
                   help="column of unique sample keys (default: <file>_<row:08d>)")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of column names")
    return names


def _delimiter(text: str) -> str:
    value = {"\\t": "\t", "tab": "\t", "comma": ","}.get(text.lower(), text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one character, e.g. ',' or '\\t' (tab)")
    return value


def _tabular_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--label-column", dest="tabular_label", default=None, metavar="COLUMN",
                   help="the 0/1 label column")
    p.add_argument("--dense-columns", type=_names, default=(), metavar="A,B,...",
                   help="numeric columns (empty, NA or NaN: missing)")
    p.add_argument("--categorical-columns", type=_names, default=(), metavar="X,Y,...",
                   help="categorical columns (strings or integers; empty: missing)")
    p.add_argument("--names", type=_names, default=None, metavar="A,B,...",
                   help="the columns of headerless files, in order (files then have no header)")
    p.add_argument("--schema", default=None, metavar="JSON",
                   help='a file {"label": ..., "dense": [...], "categorical": [...]} '
                   '(optionally "names", "delimiter"); flags given beside it win')
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="criteo: headerless TSV label,I1..I13,C1..C26; avazu: CSV with header, "
                   "label click, every column but id categorical")
    p.add_argument("--delimiter", type=_delimiter, default=None,
                   help="field separator (default by extension: .csv ',', .tsv/.tab tab); "
                   "'\\t' or tab for a tab")
    p.add_argument("--rows-per-block", type=positive_int, default=4096,
                   help="rows per block (one tar member each; default 4096)")
    p.add_argument("--max-row-size", type=parse_size, default=parse_size("1MiB"),
                   help="a longer line is a bad row (default 1MiB)")


def _tabular(args: argparse.Namespace) -> TabularOptions:
    if args.kind != "tabular":
        return TabularOptions()
    opts = TabularOptions(args.tabular_label, args.dense_columns, args.categorical_columns,
                          args.names, args.delimiter, args.rows_per_block, args.preset,
                          args.max_row_size)
    return options_from_schema_file(args.schema, opts) if args.schema else opts


def _classes_from(path: str | None, options: dict[str, object]) -> dict[str, int] | None:
    if path is None:
        return None
    classes = load_manifest(path, options).classes
    if not classes:
        raise ValueError(f"--classes-from {redact(path)}: that manifest has no class map")
    return classes


def config_from_args(args: argparse.Namespace) -> ConvertConfig:
    return ConvertConfig(
        kind=args.kind, src=args.src, out=args.out, prefix=args.prefix,
        max_count=args.max_count, max_size=args.max_size, shuffle_seed=args.shuffle_seed,
        part=args.part, on_error=args.on_error,
        limits=CheckLimits(getattr(args, "max_pixels", CheckLimits.max_pixels),
                           getattr(args, "max_text_bytes", CheckLimits.max_text_bytes),
                           getattr(args, "max_points", CheckLimits.max_points),
                           _downsize(args)),
        text=TextOptions(getattr(args, "split_lines", False), getattr(args, "text_field", "text"),
                         getattr(args, "tokenizer", None)),
        path_column=getattr(args, "path_column", "path"),
        label_column=getattr(args, "label_column", "label"),
        mask_column=getattr(args, "mask_column", None),
        max_file_bytes=getattr(args, "max_file_size", 2**30),
        classes=_classes_from(getattr(args, "classes_from", None), args.storage_options),
        parquet=ParquetOptions(getattr(args, "image_column", None),
                               getattr(args, "text_column", None),
                               getattr(args, "parquet_label", None),
                               getattr(args, "key_column", None)),
        tabular=_tabular(args), scan=_scan(args),
        max_member_bytes=getattr(args, "max_member_size", 256 * 2**20),
        workers=args.workers, overwrite=args.overwrite, worker_timeout_s=args.worker_timeout,
        storage_options=with_timeouts(args.storage_options, args.src, args.out,
                                      seconds=args.timeout),
        engine=args.engine, ray_address=args.ray_address, allow_empty=args.allow_empty)


def print_summary(m: Manifest, out: str, seconds: float) -> None:
    size = sum(s.bytes for s in m.shards)
    print(f"{out}: {len(m.shards)} shards, {m.total_samples} samples, {size / 1e6:.1f} MB "
          f"in {seconds:.1f} s ({size / 1e6 / max(seconds, 1e-9):.1f} MB/s)")
    if m.classes:
        print(f"classes: {len(m.classes)}")
        empty = _empty_classes(m)
        if empty:
            print(f"warning: {len(empty)} classes hold no sample ({', '.join(empty[:5])}"
                  f"{' ...' if len(empty) > 5 else ''}): kept in the class map, so that labels "
                  "match another split's, but no model learns them from these shards")
    elif m.labels:
        print(f"labels (no class map): {m.labels.to_json()['distinct']} distinct, "
              f"{m.labels.ranges[0][0]}..{m.labels.ranges[-1][1]}")
    elif m.modality == "pointcloud" and m.total_samples and not m.segmentation:
        print("no labels: clouds stored without one (pointcloud_loader(..., labels=False))")
    if m.tabular:
        print(f"rows: {m.tabular['rows']} in {m.tabular['blocks']} blocks")
    if m.segmentation:
        seg = m.segmentation
        print(f"scans: {seg['frames']} frames, {seg['points']} points "
              f"({seg['points_per_frame']['min']}-{seg['points_per_frame']['max']} a frame), "
              f"{len(seg['label_counts'])} classes present of {seg['num_classes']}, ignore "
              f"label {seg['ignore_label']}")
    _print_reencoded(m.reencoded)
    if m.offset_clouds:
        print(f"{m.offset_clouds} point clouds far from the origin stored relative to an "
              "offset (member .offset.npy; the loader returns it as batch.offset)")
    counts = m.to_json()["skipped_counts"]
    if counts:
        print(f"skipped {len(m.skipped)} inputs: " + ", ".join(
            f"{reason}={n}" for reason, n in counts.items()))  # type: ignore[attr-defined]
        print("every skipped input is listed under 'skipped' in manifest.json")
    if m.ignored:
        print(f"passed over {len(m.ignored)} files that are not inputs of this kind "
              "(listed under 'ignored' in manifest.json)")


def _empty_classes(m: Manifest) -> list[str]:
    """The class map's names whose label no written sample has (an empty class folder, or
    one whose every file was skipped)."""
    if not m.classes or m.labels is None:
        return []
    seen = set(m.labels.values())
    return [name for name, label in sorted(m.classes.items(), key=lambda kv: kv[1])
            if label not in seen]


def _print_reencoded(reencoded: dict[str, int]) -> None:
    """The manifest's `reencoded` in two lines: the repairs of images the loaders would
    refuse, and what --max-side did (resized, re-encoded at its quality, or kept whole for a
    mask), which is no repair."""
    for what, names in (("repaired images the loaders would refuse",
                         [r for r in reencoded if r not in OUTCOMES]),
                        ("--max-side", [r for r in reencoded if r in OUTCOMES])):
        if names:
            print(f"{what}: " + ", ".join(f"{name}={reencoded[name]}" for name in names)
                  + " (counted under 'reencoded' in manifest.json)")


def _index(args: argparse.Namespace) -> int:
    from shardflow.shards.indexing import index_source
    from shardflow.shards.tarread import TarLimits

    options = with_timeouts(args.storage_options, args.src, seconds=args.timeout)
    with tqdm(unit="shard", disable=bar_off(args.quiet), dynamic_ncols=True) as bar, \
            timed("indexing", args.src, options):
        m = index_source(args.src, args.out, limits=TarLimits(args.max_member_size),
                         on_error=args.on_error, progress=lambda _name: bar.update(),
                         storage_options=options)
    folder = Path(args.out if args.out is not None else args.src)
    print(f"indexed {len(m.shards)} shards, {m.total_samples} samples ({m.modality}) -> "
          f"{folder / 'manifest.json'}")
    if args.out is not None:
        print(f"read them with index={str(folder)!r} (verify_shards SRC --index {folder})")
    unindexed = [s for s in m.shards if s.unindexed]
    if unindexed:
        print(f"left {len(unindexed)} shards without an index; the loaders stream them, "
              "DALI's reader reads none of this folder (`shardflow convert shards` rewrites "
              "them): " + ", ".join(f"{s.name} [{s.unindexed}]" for s in unindexed[:5])
              + (" ..." if len(unindexed) > 5 else ""))
    if m.skipped:
        print(f"skipped {len(m.skipped)} samples or shards the loaders cannot read (listed "
              "under 'skipped' in manifest.json, each with its reason; verify names them)")
    return 0


def _downsize(args: argparse.Namespace) -> Downsize | None:
    if getattr(args, "max_side", None) is None:
        if getattr(args, "reencode_all", False):
            raise SystemExit("error: --reencode-all re-encodes at --max-side's settings: "
                             "give --max-side N")
        return None
    if getattr(args, "mask_column", None):
        raise SystemExit("error: --max-side with --mask-column: an image with a mask keeps "
                         "its size (the mask must fit it), so --max-side would change none; "
                         "leave it out")
    return Downsize(args.max_side, args.jpeg_quality, args.reencode_all)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kind == "merge":
        m = merge_parts(args.out, args.storage_options)
        print(f"merged: {len(m.shards)} shards, {m.total_samples} samples -> manifest.json")
        return 0
    setup_logging(args.quiet)
    if args.kind == "index":
        return _index(args)
    cfg = config_from_args(args)
    start = time.perf_counter()
    with tqdm(unit="sample", disable=bar_off(args.quiet), dynamic_ncols=True) as bar:
        def progress(samples: int, nbytes: int, total: int | None) -> None:
            bar.total = total
            bar.update(samples - bar.n)
            bar.set_postfix_str(f"{nbytes / 1e6 / max(bar.format_dict['elapsed'], 1e-3):.1f} MB/s",
                                refresh=False)
        manifest = convert(cfg, progress)
    print_summary(manifest, redact(cfg.out), time.perf_counter() - start)
    return 0


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    run_main(lambda: main(argv), hints={
        DataError: "\n(rerun the same command with --on-error skip to record bad inputs and "
                   "convert the rest; finished shards are kept)",
        WorkerError: "; finished shards are kept: rerun the same command to go on",
        # a missing source or an output already there: the message says it all (before
        # OSError, whose hint is about a full disk)
        FileNotFoundError: "", FileExistsError: "",
        TimeoutError: "; finished shards are kept: rerun the same command to go on",
        OSError: "; nothing partial was left under a final name: free space or fix the cause "
                 "and rerun the same command to finish"})


if __name__ == "__main__":
    entry()
