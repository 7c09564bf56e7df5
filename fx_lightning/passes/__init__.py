"""Graph passes: the registry, the built-in passes (one module per family) and the pipeline runner."""

from __future__ import annotations

import time
from typing import Any, List, Tuple

import torch.fx as fx

from fx_lightning.passes.base import (
    PassContext,
    PassResult,
    PassSpec,
    get_pass,
    register_pass,
    registered_passes,
    resolve_pass,
    run_pass,
)

# Importing the families registers their passes.
from fx_lightning.passes import batchnorm, cleanup, dropout  # noqa: E402,F401

__all__ = [
    "PassContext",
    "PassResult",
    "PassSpec",
    "BUILTIN_ORDER",
    "get_pass",
    "register_pass",
    "registered_passes",
    "resolve_pass",
    "run_pass",
    "run_pipeline",
    "plan_pipeline",
]

# Dropout and Identity go first so that conv -> Dropout/Identity -> BN chains become adjacent.
BUILTIN_ORDER: Tuple[str, ...] = (
    "remove_dropout",
    "remove_identity",
    "fuse_conv_bn",
    "fuse_linear_bn",
    "fuse_bn_into_next",
)
FINAL_PASSES: Tuple[str, ...] = ("eliminate_dead_code",)


def plan_pipeline(passes: Any) -> List[Tuple[PassSpec, Any]]:
    """The (pass, options) sequence a PassesConfig asks for: enabled built-ins, extras, clean-up."""
    plan: List[Tuple[PassSpec, Any]] = []
    for name in BUILTIN_ORDER:
        options = getattr(passes, name)
        if options.enabled:
            plan.append((get_pass(name), options))
    for extra in passes.extra:
        if extra.enabled:
            plan.append((resolve_pass(extra.name), extra.options))
    for name in FINAL_PASSES:
        options = getattr(passes, name)
        if options.enabled:
            plan.append((get_pass(name), options))
    return plan


def run_pipeline(
    gm: fx.GraphModule, passes: Any, ctx: PassContext
) -> List[Tuple[PassSpec, PassResult, float]]:
    """Apply ``plan_pipeline(passes)`` to ``gm`` in place; returns (pass, result, seconds) per pass."""
    out = []
    for spec, options in plan_pipeline(passes):
        start = time.perf_counter()
        result = run_pass(spec, gm, options, ctx)
        out.append((spec, result, time.perf_counter() - start))
    return out
