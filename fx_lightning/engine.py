"""``fuse()``: capture -> passes, the engine behind the callback and the CLI."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.batches import as_example_inputs
from fx_lightning.capture import capture, set_eval
from fx_lightning.config import ConfigLike, FuseConfig, load_config
from fx_lightning.passes import PassContext, plan_passes, run_passes
from fx_lightning.passes.batchnorm import unfused_batchnorm_reasons
from fx_lightning.report import FuseReport, PassReport, graph_stats

__all__ = ["FuseResult", "fuse"]


@dataclass
class FuseResult:
    graph_module: fx.GraphModule
    report: FuseReport
    config: FuseConfig
    example_inputs: Optional[tuple] = None


def fuse(
    module: nn.Module,
    config: ConfigLike = None,
    *,
    example_inputs: Union[torch.Tensor, Sequence[Any], None] = None,
) -> FuseResult:
    """Trace an eval-mode copy of ``module``, fold its BatchNorms and run the configured passes.

    ``module`` is never changed. ``example_inputs`` (a tensor or a tuple of forward's arguments) lets
    the passes see shapes (needed to fold Linear + BatchNorm1d) and enables the ``torch.export``
    capture fallback. The result's ``graph_module`` is in eval mode, on the input's device and dtype.

    Example::

        result = fx_lightning.fuse(model, example_inputs=torch.randn(1, 3, 224, 224))
        print(result.report)
        fused = result.graph_module
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fuse() takes a torch.nn.Module, got {type(module).__name__}")
    cfg = config if isinstance(config, FuseConfig) else load_config(config)
    inputs = as_example_inputs(example_inputs)
    start = time.perf_counter()
    captured = capture(module, cfg.trace, inputs)
    gm = captured.graph_module
    if captured.mode == "export":
        # torch.export leaves the working copy and its ExportedProgram in reference cycles: collect them
        # now (cheap beside export itself), so the passes' fused weights do not sit beside a dead copy.
        gc.collect()
    before = graph_stats(gm)
    ctx = PassContext(capture_mode=captured.mode, example_inputs=inputs, shapes_known=captured.mode == "export")
    reports = [
        PassReport(spec.name, spec.preserves_computation, result.changed, result.skipped, seconds)
        for spec, result, seconds in run_passes(gm, plan_passes(cfg.passes), ctx)
    ]
    report = FuseReport(
        capture_mode=captured.mode,
        before=before,
        after=graph_stats(gm),
        passes=reports,
        remaining_batchnorms=unfused_batchnorm_reasons(gm),
        notes=list(captured.notes),
        seconds=time.perf_counter() - start,
    )
    if inputs is None and captured.mode == "fx":
        report.notes.append("no example inputs: shapes unknown, so Linear + BatchNorm1d pairs were not folded")
    set_eval(gm)
    return FuseResult(gm, report, cfg, inputs)
