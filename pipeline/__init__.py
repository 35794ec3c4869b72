"""shardflow's data side: shards in, batches on the device out (see pipeline/README.md)."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy: `import pipeline` stays light (no torch/DALI) for the shard tools.
    if name == "image_loader":
        from pipeline.image import image_loader

        return image_loader
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
