"""Every refusal's advice is tested: each error below tells the user what to set; the test provokes it, checks the
advice is in the message, applies exactly that advice and shows the run then works (numbers compared with an fp64
eval copy of the original, relative error). Advice that could not work was corrected or removed (the test shows the
corrected message).

One test per advice; the docstring names the error (file and what it says)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fusion_helpers import count_batchnorms, randomize_batchnorms, reference_fp64, rel_err
from fx_lightning import ConfigError, TraceError, fuse

TOL = 1e-5


def assert_matches(model: nn.Module, fused: nn.Module, *inputs: object, tol: float = TOL) -> None:
    """``fused(*inputs)`` equals the fp64 eval copy of ``model`` to ``tol`` (relative to the output's scale)."""
    ref = reference_fp64(model, inputs)
    with torch.no_grad():
        out = fused(*inputs)
    refs, outs = (ref, out) if isinstance(ref, (tuple, list)) else ((ref,), (out,))
    assert len(refs) == len(outs)
    for o, r in zip(outs, refs):
        err = rel_err(o, r)
        assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


# --------------------------------------------------------------------------------------------- capture


class ValueGate(nn.Module):
    """A Python branch on tensor values: no tracer follows it; kept whole it runs as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.gate = ValueGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.bn(self.conv(x)))


def test_fx_trace_failure_advice_leaf_modules_works():
    """capture/graph.py _explain_fx_failure: 'torch.fx could not trace module ...: keep that module opaque:
    trace.leaf_modules: [<path>]': the path it names, set as given, captures the model."""
    model = randomize_batchnorms(GatedNet())
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "fx"}})
    found = re.search(r"trace\.leaf_modules: \['([^']+)'\]", str(raised.value))
    assert found, str(raised.value)
    result = fuse(model, {"trace": {"mode": "fx", "leaf_modules": [found.group(1)]}})
    assert count_batchnorms(result.graph_module) == 0
    for sign in (1, -1):
        assert_matches(model, result.graph_module, sign * torch.rand(2, 3, 5, 5))


class ShapeZeros(nn.Module):
    """torch.zeros(x.shape[0], ...): symbolic tracing cannot build it; torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x)).mean((2, 3))
        return y + torch.zeros(x.shape[0], 4)


def test_fx_trace_failure_advice_trace_mode_export_works():
    """capture/graph.py _explain_fx_failure: 'trace.mode: export (or auto, the default, with example inputs)'."""
    model = randomize_batchnorms(ShapeZeros())
    x = torch.randn(3, 3, 6, 6)
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "fx"}}, example_inputs=x)
    assert "trace.mode: export (or auto, the default, with example inputs)" in str(raised.value)
    for mode in ("export", "auto"):
        result = fuse(model, {"trace": {"mode": mode}}, example_inputs=x)
        assert result.report.capture_mode == "export" and count_batchnorms(result.graph_module) == 0
        assert_matches(model, result.graph_module, x)
        assert_matches(model, result.graph_module, torch.randn(5, 3, 6, 6))


def value_gate(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if x.sum() > 0 else x


class CallsFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return value_gate(self.bn(self.conv(x)))


def test_fx_trace_failure_advice_autowrap_functions_works():
    """capture/graph.py _explain_fx_failure: 'move the offending code into a free function and list it in
    trace.autowrap_functions (['pkg.module:function'])'."""
    model = randomize_batchnorms(CallsFunction())
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "fx"}})
    assert "trace.autowrap_functions (['pkg.module:function'])" in str(raised.value)
    result = fuse(model, {"trace": {"mode": "fx", "autowrap_functions": ["test_advice:value_gate"]}})
    assert count_batchnorms(result.graph_module) == 0
    for sign in (1, -1):
        assert_matches(model, result.graph_module, sign * torch.rand(2, 3, 5, 5))


class FlagArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if double:
            return y * 2
        return y


def test_fx_trace_failure_advice_concrete_args_works():
    """capture/graph.py _explain_fx_failure: 'on a flag argument, pin it with trace.concrete_args'."""
    model = randomize_batchnorms(FlagArgument())
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "fx"}})
    assert "pin it with trace.concrete_args" in str(raised.value)
    result = fuse(model, {"trace": {"mode": "fx", "concrete_args": {"double": True}}})
    assert count_batchnorms(result.graph_module) == 0
    assert_matches(model, result.graph_module, torch.randn(2, 3, 4, 4), True)


def test_auto_mode_without_example_inputs_advice_works():
    """capture/graph.py: 'trace.mode is auto but no example inputs were given, so the torch.export fallback could
    not run: pass example_inputs=(tensor, ...) to fuse()'."""
    model = randomize_batchnorms(ShapeZeros())
    with pytest.raises(TraceError) as raised:
        fuse(model)
    assert "pass example_inputs=(tensor, ...) to fuse()" in str(raised.value)
    x = torch.randn(3, 3, 6, 6)
    result = fuse(model, example_inputs=(x,))
    assert count_batchnorms(result.graph_module) == 0
    assert_matches(model, result.graph_module, x)


def test_export_mode_without_example_inputs_advice_works():
    """capture/graph.py _capture_export: 'trace.mode=export needs example inputs: pass example_inputs=(tensor, ...)
    to fuse()'."""
    model = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "export"}})
    assert "pass example_inputs=(tensor, ...) to fuse()" in str(raised.value)
    x = torch.randn(2, 3, 6, 6)
    result = fuse(model, {"trace": {"mode": "export"}}, example_inputs=(x,))
    assert count_batchnorms(result.graph_module) == 0
    assert_matches(model, result.graph_module, x)


def test_export_capture_failure_advice_leaf_module_and_fx_works():
    """capture/graph.py _exported: 'torch.export could not capture ...: Fixes: make the failing code shape-generic,
    or wrap it in a leaf module and use trace.mode: fx'."""
    model = randomize_batchnorms(GatedNet())
    x = torch.randn(2, 3, 6, 6)
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "export"}}, example_inputs=x)
    assert "wrap it in a leaf module and use trace.mode: fx" in str(raised.value)
    result = fuse(model, {"trace": {"mode": "fx", "leaf_modules": ["test_advice:ValueGate"]}}, example_inputs=x)
    assert count_batchnorms(result.graph_module) == 0
    for sign in (1, -1):
        assert_matches(model, result.graph_module, sign * torch.rand(2, 3, 5, 5))


class TypeCheckedNorm(nn.Module):
    """``isinstance(x, torch.Tensor)``: false for torch.fx's proxy, so symbolic tracing records the other branch."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return self.bn(x)
        return self.bn(x) * 2


class TypeCheckedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)
        self.norm = TypeCheckedNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.bn(self.conv(x)))


def test_unfaithful_fx_capture_advice_trace_mode_export_works():
    """capture/faithful.py: 'the fx capture of ... is unfaithful ... Fixes: trace.mode: export (or auto, the
    default, which falls back to it)'."""
    model = randomize_batchnorms(TypeCheckedNet())
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(TraceError, match="is unfaithful") as raised:
        fuse(model, {"trace": {"mode": "fx"}}, example_inputs=x)
    assert "trace.mode: export (or auto, the default, which falls back to it)" in str(raised.value)
    for mode in ("export", "auto"):
        result = fuse(model, {"trace": {"mode": mode}}, example_inputs=x)
        assert result.report.capture_mode == "export"
        assert_matches(model, result.graph_module, x)


def test_unfaithful_fx_capture_advice_leaf_modules_works():
    """capture/faithful.py: 'the fx capture of ... is unfaithful ... keep the module that differs opaque:
    trace.leaf_modules: ['pkg.module:Class']'."""
    model = randomize_batchnorms(TypeCheckedNet())
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(TraceError, match="is unfaithful") as raised:
        fuse(model, {"trace": {"mode": "fx"}}, example_inputs=x)
    assert "trace.leaf_modules: ['pkg.module:Class']" in str(raised.value)
    result = fuse(model, {"trace": {"mode": "fx", "leaf_modules": ["test_advice:TypeCheckedNorm"]}},
                  example_inputs=x)
    assert result.report.capture_mode == "fx"
    assert_matches(model, result.graph_module, x)
