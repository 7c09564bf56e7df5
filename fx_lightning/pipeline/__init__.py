"""The pipeline: capture -> passes -> verify -> export, written once.

:mod:`.steps` holds the steps (named functions with typed results), :mod:`.driver` the one function that runs
them for the callback, the preflight and the command line (:func:`run_pipeline`), :mod:`.collectives` the small
object through which a distributed run plugs in its collective calls, and :mod:`.targets` what to fuse and where.
"""

from fx_lightning.pipeline.collectives import LOCAL, Collectives, LocalCollectives
from fx_lightning.pipeline.driver import (
    Destination,
    ErrorInfo,
    Failure,
    Mode,
    Outcome,
    exchange_failure,
    fuse_and_export,
    fuse_verify_export,
    load_source,
    run_pipeline,
    summary_text,
)
from fx_lightning.pipeline.records import Batches, Exported, Fused, Observations, ObservedStep, Source
from fx_lightning.pipeline.export_step import FORMAT_NOT_EXPORTED, VARIANT_FAILED
from fx_lightning.pipeline.steps import Step, calibration_batch_count, in_step
from fx_lightning.pipeline.targets import (
    has_own_forward,
    own_rng,
    resolve_device,
    resolve_target,
    whole_model_with,
)

__all__ = [
    "FORMAT_NOT_EXPORTED",
    "VARIANT_FAILED",
    "LOCAL",
    "has_own_forward",
    "Batches",
    "Collectives",
    "Destination",
    "ErrorInfo",
    "Exported",
    "Failure",
    "Fused",
    "LocalCollectives",
    "Mode",
    "Observations",
    "ObservedStep",
    "Outcome",
    "exchange_failure",
    "Source",
    "Step",
    "calibration_batch_count",
    "fuse_and_export",
    "fuse_verify_export",
    "in_step",
    "own_rng",
    "resolve_device",
    "resolve_target",
    "load_source",
    "run_pipeline",
    "summary_text",
    "whole_model_with",
]
