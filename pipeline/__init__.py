"""shardflow's data side: shards in, batches on the device out (see pipeline/README.md)."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy: `import pipeline` stays light (no torch/DALI) for the shard tools.
    if name == "image_loader":
        from pipeline.image.loader import image_loader

        return image_loader
    if name == "text_loader":
        from pipeline.text.loader import text_loader

        return text_loader
    if name == "pointcloud_loader":
        from pipeline.pointcloud.loader import pointcloud_loader

        return pointcloud_loader
    if name == "tabular_loader":
        from pipeline.tabular.loader import tabular_loader

        return tabular_loader
    if name in ("ShardDataset", "collate_skipping"):
        from pipeline.access import dataset

        return getattr(dataset, name)
    if name == "merge_states":
        from pipeline.loading.mix import merge_states

        return merge_states
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
