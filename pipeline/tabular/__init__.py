"""Tabular (click-through-rate) rows: shards of row blocks -> decode -> feature hashing and
dense transforms (CPU) -> shuffled windows of rows -> `TabularBatch` on the device. No DALI.
See pipeline/README.md."""

from shardflow.tabular.config import FeatureSchema, TabularConfig
from shardflow.tabular.loader import TabularLoader, tabular_loader

__all__ = ["FeatureSchema", "TabularConfig", "TabularLoader", "tabular_loader"]
