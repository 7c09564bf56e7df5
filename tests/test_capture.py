"""Capture: leaf policy, autowrap, explained trace failures, torch.export mode and the auto fallback."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from torch import nn

from fusion_helpers import assert_exact, count_batchnorms, fingerprint, randomize_batchnorms
from fx_lightning import TraceError, fuse
from fx_lightning.common.calls import Call
from fx_lightning.capture.graph import CAPTURE_FELL_BACK
from pool_library import global_pool


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on tensor values: no tracer can capture this
            return x * 2
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.gate = DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.stem(x))


def test_trace_failure_names_module_line_and_fixes():
    with pytest.raises(TraceError) as info:
        fuse(Net(), {"trace": {"mode": "fx"}})
    message = str(info.value)
    assert "module 'gate' (DataDependent)" in message
    assert "test_capture.py" in message and "if x.sum() > 0" in message
    assert "trace.leaf_modules" in message and "trace.autowrap_functions" in message
    assert "trace.mode: export" in message


def test_leaf_module_from_config_makes_it_traceable():
    model = randomize_batchnorms(Net())
    result = fuse(model, {"trace": {"leaf_modules": ["test_capture.DataDependent"]}})
    gate = [n for n in result.graph_module.graph.nodes if n.op == "call_module" and n.target == "gate"]
    assert len(gate) == 1
    assert count_batchnorms(result.graph_module) == 0
    assert_exact(model, result.graph_module, (torch.randn(2, 3, 5, 5),))


class GatedWithNorm(nn.Module):
    """A data-dependent branch and a BatchNorm of its own: kept whole as a leaf, its BatchNorm stays in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        return y * 2 if y.sum() > 0 else y


def test_batchnorms_inside_leaf_modules_are_counted_as_left_with_the_reason():
    """Earlier the report said "left: 0" while the leaf's BatchNorm was still in the export."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), GatedWithNorm())
    randomize_batchnorms(model)
    result = fuse(model, {"trace": {"mode": "fx", "leaf_modules": ["test_capture.GatedWithNorm"]}},
                  example_inputs=torch.randn(2, 3, 6, 6))
    assert result.report.batchnorms_folded == 1 and result.report.after.batchnorms == 1
    (left,) = result.report.remaining_batchnorms
    assert left.node == "2.bn" and "inside GatedWithNorm '2'" in left.reason and "not folded" in left.reason
    assert_exact(model, result.graph_module, (torch.randn(2, 3, 6, 6),))


def gated(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if x.sum() > 0 else x


class UsesFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated(self.bn(self.conv(x)))


def test_autowrap_function_from_config():
    model = randomize_batchnorms(UsesFunction())
    with pytest.raises(TraceError):
        fuse(model, {"trace": {"mode": "fx"}})
    result = fuse(model, {"trace": {"autowrap_functions": ["test_capture:gated"]}})
    assert count_batchnorms(result.graph_module) == 0
    for sign in (1, -1):
        assert_exact(model, result.graph_module, (sign * torch.rand(2, 3, 4, 4),))


class ShapeDependent(nn.Module):
    """fx cannot build torch.zeros(x.shape[0], ...); torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x)).mean((2, 3))
        return y + torch.zeros(x.shape[0], 4)


def test_auto_mode_falls_back_to_export_and_still_folds():
    model = randomize_batchnorms(ShapeDependent())
    x = torch.randn(3, 3, 6, 6)
    result = fuse(model, example_inputs=x)
    assert result.report.capture_mode == "export"
    note = result.report.notes[0]
    assert note.kind == CAPTURE_FELL_BACK and note["what"] == "failed"
    assert count_batchnorms(result.graph_module) == 0
    assert_exact(model, result.graph_module, (x,))
    assert_exact(model, result.graph_module, (torch.randn(5, 3, 6, 6),))  # dynamic batch


@pytest.mark.parametrize("dynamic_batch", [True, False])
def test_export_dynamic_batch_decides_the_captured_sample_axis(dynamic_batch: bool) -> None:
    """One knob: ``export.dynamic_batch`` marks the torch.export capture's sample axis dynamic, or fixes it."""
    model = randomize_batchnorms(ShapeDependent())
    x = torch.randn(3, 3, 6, 6)
    result = fuse(model, {"trace": {"mode": "export"}, "export": {"dynamic_batch": dynamic_batch}}, example_inputs=x)
    assert_exact(model, result.graph_module, (x,))
    if dynamic_batch:
        assert_exact(model, result.graph_module, (torch.randn(5, 3, 6, 6),))
    else:
        with pytest.raises(Exception, match="== 3"):  # torch.export's guard: the graph takes the example's 3 only
            result.graph_module(torch.randn(5, 3, 6, 6))


def test_auto_mode_without_inputs_says_how_to_enable_fallback():
    with pytest.raises(TraceError, match="example_inputs"):
        fuse(ShapeDependent())


def test_export_mode_needs_example_inputs():
    with pytest.raises(TraceError, match="needs example inputs"):
        fuse(nn.Linear(2, 2), {"trace": {"mode": "export"}})


class TrainingBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if self.training:
            return y * 100.0
        return y


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_input_in_train_mode_is_traced_in_eval_mode_and_left_in_train_mode(mode):
    model = randomize_batchnorms(TrainingBranch()).train()
    before = fingerprint(model)
    x = torch.randn(2, 3, 4, 4)
    result = fuse(model, {"trace": {"mode": mode}}, example_inputs=x)
    assert fingerprint(model) == before and model.training
    assert not result.graph_module.training
    assert_exact(model, result.graph_module, (x,))  # the reference is eval-mode: no * 100


def test_bad_leaf_module_path_is_a_config_error():
    from fx_lightning import ConfigError

    with pytest.raises(ConfigError, match=r"trace.leaf_modules\[0\]"):
        fuse(Net(), {"trace": {"leaf_modules": ["no.such.Module"]}})


def _users_line_reading_a_missing_argument() -> None:
    from fx_lightning.common.calls import Call, value_at

    value_at(Call((), {}), [("kwarg", "x")])  # raises in the package's common/calls.py


def test_the_users_line_in_a_capture_error_is_never_inside_the_package():
    """After the package was laid out in folders, the filter of its own frames took fx_lightning/capture/ for the
    package, so an error raised in fx_lightning/common/ was named as the user's line."""
    from fx_lightning.capture.fx_failure import user_frame as _user_frame, user_frames as _user_frames

    with pytest.raises(KeyError) as info:
        _users_line_reading_a_missing_argument()
    where = _user_frame(info.value)
    assert where is not None and where.startswith(__file__) and "_users_line_reading" in where, where
    assert [f.f_code.co_name for f in _user_frames(info.value)][-1] == "_users_line_reading_a_missing_argument"


class ValueBranch(nn.Module):
    """A Python branch on a tensor's values whose ways compute differently: torch.fx cannot follow it, torch.export
    captures one way (the example's), so calls taking both ways leave no capture, and nothing below the root can be
    kept whole instead."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if x.sum() > 0:
            return y
        return -y


def _both_ways() -> Dict[str, Any]:
    """fuse()'s arguments with calls taking both ways of the branch on ``x.sum()``."""
    x = torch.rand(2, 3, 4, 4)
    return dict(example_inputs=x, check_inputs=[Call((-x,))])


def test_when_both_captures_fail_the_advice_does_not_name_the_mode_just_tried():
    """auto tries torch.export after symbolic tracing: advising ``trace.mode: export`` then is advice shown not to
    work."""
    with pytest.raises(TraceError, match="Neither capture mode worked") as raised:
        fuse(ValueBranch(), **_both_ways())
    assert "trace.mode: export" not in str(raised.value)
    assert "trace.autowrap_functions" in str(raised.value)  # the fixes that remain are still said


class InnerValueBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


class ValueBranches(ValueBranch):
    """A branch on values in a submodule and another in the root's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = InnerValueBranch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.inner(x))


def test_advice_to_keep_whole_what_was_kept_whole_and_still_failed_is_not_given():
    """Held-out check 8 (e3nn): the refusal advised trace.leaf_modules for the module symbolic tracing failed in,
    which the automatic route had kept whole, tracing then failing again: advice shown not to work. It now says
    what was kept whole and where tracing failed next."""
    with pytest.raises(TraceError, match="Neither capture mode worked") as raised:
        fuse(ValueBranches(), **_both_ways())
    message = str(raised.value)
    assert "keep that module opaque" not in message and "InnerValueBranch']" not in message, message
    assert f"Kept whole, tracing still failed ({__name__}.InnerValueBranch): torch.fx could not trace the root " \
           "module" in message, message
    assert "wrap it in a leaf module" not in message and raised.value.fix.startswith("no setting is known"), message


def test_keeping_whole_stops_when_the_failure_is_at_a_module_already_kept(monkeypatch):
    """A failure reported at a module already kept whole (fx cannot make a node of the arguments of its call: a
    library's batch object) was taken out of the list and put back, forever: the preflight hung (torch_geometric's
    GATv2Conv called with a Batch). It is now refused as neither capture working."""
    import fx_lightning.capture.graph as graph

    class Kept(nn.Module):
        pass

    tries = []

    def failing(working, trace, kept_whole=(), call=None):
        tries.append(tuple(kept_whole))
        if len(tries) > 50:
            raise AssertionError("the kept-whole loop does not end")
        error = TraceError("fails at a module kept whole")
        error.keep_functions, error.keep_module = [], Kept
        raise error

    monkeypatch.setattr(graph, "_capture_fx", failing)
    first = TraceError("first failure")
    first.keep_functions, first.keep_module = [], Kept
    assert graph._capture_fx_keeping_whole(nn.Linear(2, 2), None, None, (), first)[0] is None
    assert tries == [(Kept,)]


class PooledGraphs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.head(global_pool(self.bn(self.lin(x)), index))


def test_a_library_function_is_kept_whole_from_where_the_model_calls_it():
    """The function that fails (scatter_sum) is called inside the library, where torch.fx does not patch it: kept
    whole it still failed, and the whole model was kept instead (torch_geometric: "Neither capture mode worked").
    The function the model's code calls around it (global_pool) is kept whole next, and the rest is fused."""
    model = randomize_batchnorms(PooledGraphs()).eval()
    index = torch.tensor([0, 0, 1, 1, 1, 2])
    result = fuse(model, example_inputs=(torch.randn(6, 4), index))
    assert result.report.capture_mode == "fx"
    assert any("global_pool" in str(note) for note in result.report.notes)
    assert count_batchnorms(result.graph_module) == 0
    assert_exact(model, result.graph_module, (torch.randn(9, 4), torch.tensor([0, 1, 1, 2, 2, 2, 3, 4, 4])))
