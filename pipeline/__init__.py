"""shardflow: WebDataset shards in, batches on the device out (see pipeline/README.md).

The training side is `shardflow.trainers`, the commands and benchmarks `shardflow.tools`."""

from typing import TYPE_CHECKING

__version__ = "0.2.0"

if TYPE_CHECKING:  # what __getattr__ gives, for the type checker
    from shardflow import ops as ops
    from shardflow.compose import fields as fields
    from shardflow.compose.pipeline import Pipeline as Pipeline


# What `from shardflow import *`, dir(shardflow) and an editor's completion list: each is
# imported on first use (__getattr__).
__all__ = ["image_loader", "text_loader", "pointcloud_loader", "tabular_loader", "Pipeline",
           "fields", "ops", "ShardDataset", "collate_skipping", "merge_states", "__version__"]


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))


def __getattr__(name: str) -> object:
    # Lazy: `import shardflow` stays light (no torch/DALI) for the shard tools.
    if name == "image_loader":
        from shardflow.image.loader import image_loader

        return image_loader
    if name == "text_loader":
        from shardflow.text.loader import text_loader

        return text_loader
    if name == "pointcloud_loader":
        from shardflow.pointcloud.loader import pointcloud_loader

        return pointcloud_loader
    if name == "tabular_loader":
        from shardflow.tabular.loader import tabular_loader

        return tabular_loader
    if name in ("ShardDataset", "collate_skipping"):
        from shardflow.access import dataset

        return getattr(dataset, name)
    if name == "Pipeline":
        from shardflow.compose.pipeline import Pipeline

        return Pipeline
    if name in ("fields", "ops"):  # sf.fields.Image(...), sf.ops.RandAugment()
        import importlib

        return importlib.import_module(f"shardflow.{'compose.' if name == 'fields' else ''}"
                                       f"{name}")
    if name == "merge_states":
        from shardflow.loading.mix import merge_states

        return merge_states
    raise AttributeError(f"module 'shardflow' has no attribute {name!r}")
