"""Memory while fusing: structural checks, not timings.

``fuse()`` may hold the original plus one working copy of the target, no more: the result shares no
storage with the input, holds no more weight bytes than it, the unfused weights of the working copy are
freed as each is replaced (not when the cyclic GC happens to run), and the peak RSS of fusing resnet50,
measured in a fresh process, stays under 2.5x the model's parameter bytes (benchmarks/memory.py
measures the same for the README).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torchvision
from torch import nn

import fx_lightning
import fx_lightning.capture.graph as capture_mod

REPO = Path(__file__).resolve().parents[1]
TARGET_X = 2.5


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return itertools.chain(module.parameters(), module.buffers())


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(module))


def _storages(module: nn.Module) -> set:
    return {t.untyped_storage().data_ptr() for t in _tensors(module) if t.numel()}


def _randomise_bn(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return model.eval()


class _Net(nn.Module):
    """Conv-BN pairs (module form) and a functional conv + batch_norm whose weights are get_attr."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        self.w3 = nn.Parameter(torch.randn(8, 32, 1, 1))
        self.b3 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        x = self.b3(torch.nn.functional.conv2d(x, self.w3))
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_result_shares_no_storage_and_is_no_larger(mode: str) -> None:
    model = _randomise_bn(_Net())
    x = torch.randn(2, 3, 8, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    result = fx_lightning.fuse(model, {"trace": {"mode": mode}}, example_inputs=x)
    gm = result.graph_module
    assert result.report.batchnorms_folded == 3
    assert not (_storages(gm) & _storages(model)), "the fused model aliases the input's tensors"
    assert _nbytes(gm) <= _nbytes(model)
    # And the input is untouched (its weights were read, never written).
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_working_copy_is_freed_before_fuse_returns(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor of the deep copy that the result does not keep is freed by the time fuse() returns,
    with the automatic cyclic GC off.

    torch.fx's tracer and torch.export leave reference cycles that reach the working copy; if they held
    it, the whole unfused copy would live beside the fused weights until a GC pass (2x the model).
    """
    refs: List[weakref.ref] = []
    real_eval_copy = capture_mod.eval_copy

    def recording_eval_copy(module: nn.Module, device: Any = None) -> nn.Module:
        working = real_eval_copy(module, device)
        refs.extend(weakref.ref(t) for t in _tensors(working))
        return working

    import fx_lightning.pipeline.engine as engine_mod

    monkeypatch.setattr(capture_mod, "eval_copy", recording_eval_copy)
    monkeypatch.setattr(engine_mod, "eval_copy", recording_eval_copy)  # fuse() makes the working copy
    model = _randomise_bn(torchvision.models.resnet18(weights=None))
    x = torch.randn(1, 3, 64, 64)
    gc.collect()
    gc.disable()  # only reference counting may free the copy
    try:
        result = fx_lightning.fuse(model, {"trace": {"mode": mode}}, example_inputs=x)
        kept = _storages(result.graph_module)
        alive = [t for t in (r() for r in refs) if t is not None]
        leaked = [t for t in alive if t.untyped_storage().data_ptr() not in kept]
        leaked_bytes = sum(t.numel() * t.element_size() for t in leaked)
        n_leaked = len(leaked)
        del alive, leaked
    finally:
        gc.enable()
    assert refs, "eval_copy was not called: the test no longer watches the working copy"
    assert result.report.batchnorms_folded == 20
    # Tolerance: small tensors a pass may still reference (BN statistics live until the pass ends).
    assert leaked_bytes <= 0.01 * _nbytes(model), (
        f"{n_leaked} tensors ({leaked_bytes / 2**20:.1f} MiB) of the working copy are still alive"
    )


def test_replaced_constant_weights_are_freed_as_they_are_replaced() -> None:
    """Functional/ATen layers (export capture) get new get_attr weights; the old ones go at once, not at
    the end of the pass, and a weight another node still reads stays."""
    from fx_lightning.capture.graph import capture
    from fx_lightning.config import TraceConfig
    from fx_lightning.passes.bn_views import Layer, apply_layer_weights, match_layer

    model = _randomise_bn(_Net())
    gm = capture(model, TraceConfig(mode="export"), (torch.randn(2, 3, 8, 8),)).graph_module
    gc.collect()  # as fuse() does after an export capture: torch.export's cycles hold the working copy
    layers = [lay for n in gm.graph.nodes if isinstance(lay := match_layer(gm, n), Layer)]
    convs = [lay for lay in layers if lay.kind == "conv"]
    assert len(convs) == 3 and all(lay.module is None for lay in convs)
    first, second = convs[0], convs[1]
    old_target = str(first.node.args[1].target)
    old_ref = weakref.ref(first.weight)
    # Make the second conv read the first conv's weight too, through its own get_attr node (a constant
    # another node still reads must survive).
    second_w = second.node.args[1]
    with gm.graph.inserting_before(second.node):
        alias = gm.graph.get_attr(old_target)
    second.node.args = (second.node.args[0], alias, *second.node.args[2:])
    gm.graph.erase_node(second_w)

    # Replace the second conv's (shared) weight: the first conv still reads it, so it stays.
    apply_layer_weights(gm, second, torch.zeros(32, 16, 3, 3), torch.zeros(32), copy_shared=True)
    assert old_target in {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    assert gm.get_parameter(old_target) is old_ref()
    # Replace the first conv's: now nothing reads it, and it is gone at once.
    w, b = first.weight.clone(), torch.zeros(first.out_channels)
    del first.weight
    apply_layer_weights(gm, first, w, b, copy_shared=True)
    assert old_target not in {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    with pytest.raises(AttributeError):
        gm.get_parameter(old_target)
    assert old_ref() is None, "the replaced weight is still referenced"
    gm.graph.lint()


_CHILD = r"""
import gc, json, sys, torch, torchvision, fx_lightning
torch.set_num_threads(1)
def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out
torch.manual_seed(0)
model = torchvision.models.get_model(sys.argv[1], weights=None).eval()
with torch.no_grad():
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1); m.running_var.uniform_(0.5, 2)
nbytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
x = torch.randn(1, 3, 224, 224)
gc.collect()
before = status()["VmRSS"]
open("/proc/self/clear_refs", "w").write("5")
reset = status()["VmHWM"] - before
result = fx_lightning.fuse(model, example_inputs=x)
peak = status()["VmHWM"] - before
print(json.dumps({"x": peak / nbytes, "reset_slack": reset, "folded": result.report.batchnorms_folded}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS via /proc/self/status is Linux-only")
def test_peak_rss_of_fusing_resnet50_is_under_target() -> None:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("/proc/self/clear_refs is not writable: cannot reset the peak RSS")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, "resnet50"], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: Dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["reset_slack"] < 8 << 20, "VmHWM was not reset"
    assert out["folded"] == 53
    # Measured 1.2x (benchmarks/results/memory.md); 2.0x before the tracer stopped pinning the copy.
    assert out["x"] <= TARGET_X, f"fusing resnet50 took {out['x']:.2f}x its parameter bytes of extra RSS"
