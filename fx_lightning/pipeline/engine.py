"""``fuse()``: module passes -> capture -> graph passes, the engine behind the callback and the CLI."""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.common.batches import detached, example_call, model_device_dtype
from fx_lightning.common.calls import Call, Interface, run_seeded
from fx_lightning.capture.graph import capture
from fx_lightning.capture.working_copy import eval_copy, set_eval
from fx_lightning.config import ConfigLike, FuseConfig, load_config
from fx_lightning.common.notes import NoteKind
from fx_lightning.parity.compare import compare_outputs
from fx_lightning.common.tolerance import rounding_tolerance
from fx_lightning.passes import (
    PassContext,
    PassResult,
    PassSpec,
    RemainingBatchNorm,
    Skip,
    Stage,
    plan_passes,
    run_passes,
)
from fx_lightning.passes.batchnorm import unfused_batchnorm_reasons
from fx_lightning.passes.graph_utils import is_batchnorm_like, looks_like_batchnorm
from fx_lightning.capture.fuse_report import FuseReport, GraphStats, PassReport, batchnorms_in_leaves, graph_stats
from fx_lightning.signature.signature import Signature
from fx_lightning.signature.value_guards import Guarded, ValueBranches

__all__ = ["FuseResult", "fuse", "NO_EXAMPLE_INPUTS", "FLAT_INTERFACE"]

FLAT_INTERFACE = NoteKind("flat_interface", "captured through a flat interface: one tensor per input leaf "
                                            "({names}), the original arguments rebuilt inside, outputs made plain")
NO_EXAMPLE_INPUTS = NoteKind("no_example_inputs", "no example inputs: shapes unknown (Linear + BatchNorm1d pairs not "
                                                  "folded) and the capture not run against the model")


@dataclass
class FuseResult:
    """``graph_module``: the fused graph. It takes what the model's forward takes, unless the call was not
    positional tensors or the outputs not plain (``interface.flat``): then it takes one tensor per input leaf
    (``interface.names``) and returns the outputs in plain containers, and :attr:`module` is the fused model behind
    the original interface (the user's objects in, the original output types out)."""

    graph_module: fx.GraphModule
    report: FuseReport
    config: FuseConfig
    example_inputs: Optional[tuple] = None  # what graph_module was captured with (the leaves, when flat)
    interface: Optional[Interface] = None
    # The input shapes graph_module is fixed to (a torch.export capture whose sizes could not stay dynamic).
    static_shapes: Optional[List[List[int]]] = None
    # Conditions on the input sizes torch.export's guards put on the capture (signature/conditions.py).
    conditions: List[str] = field(default_factory=list)
    # Branches on tensor values captured the example's way (signature/value_guards.py): a guard program where kept.
    value_branches: Optional[ValueBranches] = None

    @property
    def guarded_branches(self) -> List[str]:
        """The branches on values every observed call took one way, which the guard program refuses the other way."""
        return list(self.value_branches.kept) if self.value_branches is not None else []

    @property
    def guarded(self) -> nn.Module:
        """The fused graph behind its value guards, where it has any (a call taking another way is refused)."""
        guards = self.value_branches.guards if self.value_branches is not None else None
        return self.graph_module if guards is None else \
            Guarded(self.graph_module, guards.module(), self.value_branches.kept, "the fused model")

    @property
    def module(self) -> nn.Module:
        """The fused model, called as the original is."""
        return self.interface.structured(self.guarded) if self.interface is not None else self.guarded


def fuse(
    module: nn.Module,
    config: ConfigLike = None,
    *,
    example_inputs: Union[torch.Tensor, Sequence[Any], Call, None] = None,
    signature: Optional[Signature] = None,
    check_inputs: Sequence[Call] = (),
    observed_inputs: Sequence[Call] = (),
) -> FuseResult:
    """Trace an eval-mode copy of ``module``, fold its BatchNorms and run the configured passes.

    ``module`` is never changed. ``example_inputs`` (a tensor, a tuple of forward's arguments, or a
    :class:`~fx_lightning.common.calls.Call` with keyword arguments) lets the passes see shapes (needed to fold Linear +
    BatchNorm1d) and enables the ``torch.export`` capture fallback. ``signature`` (what observed calls showed:
    which dimensions vary) and ``check_inputs`` (more calls, of other sizes) make the capture take every size the
    calls took; ``observed_inputs`` (every call observed) decide a branch on tensor values. The result's ``graph_module`` is in eval mode, on the input's device and dtype.

    Example::

        result = fx_lightning.fuse(model, example_inputs=torch.randn(1, 3, 224, 224))
        print(result.report)
        fused = result.graph_module
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fuse() takes a torch.nn.Module, got {type(module).__name__}")
    cfg = config if isinstance(config, FuseConfig) else load_config(config)
    call = example_call(example_inputs)
    inputs = call.args if call is not None and not call.kwargs else None  # the module passes' positional inputs
    start = time.perf_counter()
    plan = plan_passes(cfg.passes)
    working = eval_copy(module)
    batchnorm_modules = _count_batchnorm_modules(working)
    module_runs = run_passes(working, plan, PassContext(capture_mode="module", example_inputs=inputs), Stage.module)
    undone = _module_passes_unfaithful(module, working, module_runs, inputs, cfg)
    if undone is not None:  # third-party conversion code changed what the model computes: none of it stays
        working = eval_copy(module)
        module_runs = [(spec, _undone(result, undone), seconds) for spec, result, seconds in module_runs]
    removed = batchnorm_modules - _count_batchnorm_modules(working)  # by deploy-form conversions
    interface = Interface.of(working, call, run_seeded(working, call)) if call is not None else None
    captured = capture(interface.module if interface is not None else working, cfg.trace,
                       interface.call if interface is not None else None, already_copied=True, signature=signature,
                       check=[interface.leaves_of(c) for c in check_inputs] if interface is not None else (),
                       dynamic_samples=cfg.export.dynamic_batch,
                       observed=[interface.leaves_of(c) for c in observed_inputs] if interface is not None else ())
    if interface is not None:
        inputs = interface.call.args
        if interface.flat:
            captured.notes.append(FLAT_INTERFACE(names=tuple(interface.names)))
        interface = dataclasses.replace(interface, module=None)
    del working  # the graph module holds what it uses
    gm = captured.graph_module
    if captured.mode == "export":
        # torch.export leaves the working copy and its ExportedProgram in reference cycles: collect them
        # now (cheap beside export itself), so the passes' fused weights do not sit beside a dead copy.
        gc.collect()
    inlined = len(captured.inlined_batchnorms)
    before = _with_batchnorms(graph_stats(gm), removed + inlined)
    ctx = PassContext(capture_mode=captured.mode, example_inputs=inputs, shapes_known=captured.mode == "export")
    graph_runs = run_passes(gm, plan, ctx, Stage.graph)
    report = FuseReport(
        capture_mode=captured.mode,
        before=before,
        after=_with_batchnorms(graph_stats(gm), inlined),
        passes=[PassReport(spec.name, spec.preserves_computation, result.changed, result.skipped, seconds)
                for spec, result, seconds in module_runs + graph_runs],
        remaining_batchnorms=captured.inlined_batchnorms + _with_pass_reasons(unfused_batchnorm_reasons(gm), graph_runs)
        + batchnorms_in_leaves(gm),
        notes=list(captured.notes),
        seconds=time.perf_counter() - start,
    )
    if inputs is None and captured.mode == "fx":
        report.notes.append(NO_EXAMPLE_INPUTS())
    set_eval(gm)
    return FuseResult(gm, report, cfg, inputs, interface, captured.static_shapes, captured.conditions,
                      captured.value_branches)


def _module_passes_unfaithful(original: nn.Module, working: nn.Module, runs: List[Any], inputs: Optional[tuple],
                              cfg: FuseConfig) -> Optional[str]:
    """How the module-stage passes (a model's own deploy-form conversions, declared BatchNorm forms) changed the
    whole model's outputs on the example inputs, structure first (None: they did not, or nothing changed, or
    there are no inputs). Each pass checks the modules it converts; this catches a conversion that reaches
    outside its module, or one no input reached. Runs only when a module-stage pass changed something."""
    if inputs is None or not any(result.changed for _, result, _ in runs):
        return None
    want = detached(run_seeded(eval_copy(original), Call(inputs)))  # the copy is freed before the next run
    got = run_seeded(working, Call(inputs))
    _, dtype = model_device_dtype(working)
    comparison = compare_outputs(got, want, rtol=max(cfg.parity.rtol, rounding_tolerance(dtype or torch.float32)))
    return None if comparison.passed else comparison.describe()


def _undone(result: PassResult, why: str) -> PassResult:
    """The pass's changes, each reported as undone."""
    skipped = [Skip.of(c.node, f"undone: with the module-stage conversions the model's outputs differed from the "
                               f"original on the example inputs ({why})", module=c.module) for c in result.changed]
    return PassResult(changed=[], skipped=list(result.skipped) + skipped)


def _with_pass_reasons(
    remaining: List[RemainingBatchNorm], runs: List[Tuple[PassSpec, PassResult, float]]
) -> List[RemainingBatchNorm]:
    """Each BatchNorm left, with the reason a pass gave for leaving it when one did (the most specific)."""
    given = {s.node: s.reason for _, result, _ in runs for s in result.skipped}
    return [dataclasses.replace(r, reason=given.get(r.node, r.reason)) for r in remaining]


def _count_batchnorm_modules(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if is_batchnorm_like(m) or looks_like_batchnorm(m))


def _with_batchnorms(stats: GraphStats, extra: int) -> GraphStats:
    return dataclasses.replace(stats, batchnorms=stats.batchnorms + extra)
