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
    fuse_and_export,
    fuse_verify_export,
    run_pipeline,
    summary_text,
)
from fx_lightning.pipeline.steps import Batches, Exported, Fused, Source, Step, calibration_batch_count, in_step
from fx_lightning.pipeline.targets import (
    own_rng,
    resolve_device,
    resolve_target,
    target_example_inputs,
    whole_model_with,
)

__all__ = [
    "LOCAL",
    "Batches",
    "Collectives",
    "Destination",
    "ErrorInfo",
    "Exported",
    "Failure",
    "Fused",
    "LocalCollectives",
    "Mode",
    "Outcome",
    "Source",
    "Step",
    "calibration_batch_count",
    "fuse_and_export",
    "fuse_verify_export",
    "in_step",
    "own_rng",
    "resolve_device",
    "resolve_target",
    "run_pipeline",
    "summary_text",
    "target_example_inputs",
    "whole_model_with",
]
