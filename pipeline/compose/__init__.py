"""Pipelines you compose: fields per member, per-sample Python, batching (see README.md)."""

from shardflow.compose import fields
from shardflow.compose.pipeline import Pipeline, PipelineLoader, SampleBatch

__all__ = ["Pipeline", "PipelineLoader", "SampleBatch", "fields"]
