"""Is a capture faithful? The captured graph is run against the eager module on the same inputs (eval mode, no
grad, a fixed RNG); where it raises or gives other numbers, the error says where it first goes wrong and what to
change. Used by :mod:`fx_lightning.capture.graph` on every graph it returns."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.common.batches import describe_call, flat_tensors
from fx_lightning.common.calls import Call, run_seeded
from fx_lightning.errors import TraceError, first_line
from fx_lightning.parity.compare import compare_outputs


def raise_if_unfaithful(graph_module: fx.GraphModule, mode: str, working: nn.Module, call: Optional[Call],
                        check: Sequence[Call] = ()) -> None:
    """Run the graph captured by ``mode`` ("fx" or "export") against the eager module on the example (and on the
    ``check`` calls, other sizes it must take); raise a TraceError saying where it goes wrong when it raises or
    gives other numbers."""
    if call is None:
        return
    for index, inputs in enumerate([call, *check]):
        expected = run_seeded(working, inputs)
        try:
            got = run_seeded(graph_module, inputs)
        except Exception as exc:  # noqa: BLE001 - a graph that raises is the clearest sign of a wrong trace
            problem = f"the captured graph raises {first_line(exc, with_type=True)}"
        else:
            problem = _difference(got, expected)
        if problem is None:
            continue
        where = _first_divergence(graph_module, working, inputs) if mode == "fx" else None
        which = "on the example inputs" if index == 0 else \
            f"on observed call {index + 1} ({describe_call(inputs)})"
        raise TraceError(
            f"the {mode} capture of {type(working).__qualname__} is unfaithful: {which} {problem}"
            + (f"\n  first difference at {where}" if where else "")
            + (_FX_UNFAITHFUL_FIXES if mode == "fx" else _EXPORT_UNFAITHFUL_FIXES)
        )


_FX_UNFAITHFUL_FIXES = (
    "\n  Python code that depends on shapes or types can be recorded wrongly by symbolic tracing. Fixes:"
    "\n  - trace.mode: export (or auto, the default, which falls back to it)"
    "\n  - keep the module that differs opaque: trace.leaf_modules: ['pkg.module:Class']"
)
_EXPORT_UNFAITHFUL_FIXES = (
    "\n  torch.export specialised the graph to something the example inputs do not meet. Fixes:"
    "\n  - trace.mode: fx, with the offending module kept opaque: trace.leaf_modules: ['pkg.module:Class']"
    "\n  - export.dynamic_batch: false, when the model fixes its batch size"
)


def _difference(got: Any, expected: Any) -> Optional[str]:
    """How the captured graph's outputs differ from the model's (None: within float rounding, the same kernels
    having run; structure included: count, nesting, shapes, dtypes)."""
    comparison = compare_outputs(got, expected)
    return None if comparison.passed else comparison.describe().replace("the reference", "the model")


def _first_divergence(gm: fx.GraphModule, working: nn.Module, inputs: Call) -> Optional[str]:
    """The first module call of the graph whose output differs from (or raises unlike) the eager module's."""
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    eager: Dict[str, List[torch.Tensor]] = {}
    def record(name: str, _m: nn.Module, _args: Any, out: Any) -> None:  # returns None: the output stays the module's
        eager.setdefault(name, [t.detach().clone() for t in flat_tensors(out)])  # in-place ops come later

    handles = [sub.register_forward_hook(functools.partial(record, name)) for name, sub in working.named_modules()
               if name in targets]
    try:
        run_seeded(working, inputs)
    finally:
        for h in handles:
            h.remove()
    found: List[str] = []

    class Watch(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            try:
                out = super().run_node(n)
            except Exception as exc:
                found.append(f"node {n.name} ({n.op} {n.target}): it raises {first_line(exc, with_type=True)}")
                raise
            if n.op == "call_module" and not found and str(n.target) in eager:
                problem = _difference(flat_tensors(out), eager[str(n.target)])
                if problem is not None:
                    found.append(f"module '{n.target}' ({n.name}): {problem.replace('the captured graph', 'it')}")
            return out

    try:
        run_seeded(lambda *args, **kwargs: Watch(gm).run(*args, **kwargs), inputs)
    except Exception:  # noqa: BLE001 - recorded in `found`
        pass
    return found[0] if found else None
