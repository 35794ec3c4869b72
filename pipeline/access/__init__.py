"""Looking into a shard set: random access by index or key (dataset.py) and decoding one
sample with the loaders' checks (decode.py)."""
