"""Every torchvision classification model with BatchNorm: fused exactly, and every BN that directly
follows a single-use conv is folded; as built and as DDP training hands it over (SyncBatchNorm
converted, then reverted to _BatchNormXd by Lightning).

The default run covers all 58 (about 3 minutes on 2 cores). regnet_y_128gf (644M parameters) peaks
near 9 GB, so its two tests hold a file lock that keeps them from running side by side under xdist;
set FXL_SKIP_HUGE=1 on a machine with less than ~16 GB of memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

torchvision = pytest.importorskip("torchvision")

from fusion_helpers import (  # noqa: E402
    count_batchnorms, fingerprint, foldable_after_conv, randomize_batchnorms, rel_err, reference_fp64,
)
from fx_lightning import fuse  # noqa: E402
from fx_lightning.common.calls import map_leaves  # noqa: E402
from fx_lightning.parity.compare import structure_mismatch  # noqa: E402

FAMILIES = [
    "resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v2", "mobilenet_v3_small",
    "mobilenet_v3_large", "efficientnet_b0", "efficientnet_v2_s", "regnet_x_400mf", "regnet_y_400mf",
    "shufflenet_v2_x0_5", "mnasnet0_5", "googlenet", "inception_v3", "densenet121", "vgg11_bn",
]


def _all_bn_models() -> list:
    names = torchvision.models.list_models(module=torchvision.models)
    # Known to contain BatchNorm (checked by building each); maxvit_t too (a hybrid with BN in its stem/MBConv).
    prefixes = ("resnet", "resnext", "wide_resnet", "mobilenet", "efficientnet", "regnet", "shufflenet",
                "mnasnet", "googlenet", "inception", "densenet", "vgg", "maxvit")
    return [n for n in names if n.startswith(prefixes) and (not n.startswith("vgg") or n.endswith("_bn"))]


def build(name: str) -> nn.Module:
    kwargs = {"weights": None}
    if name in ("googlenet", "inception_v3"):
        kwargs.update(init_weights=False, aux_logits=False)
    torch.manual_seed(0)
    return torchvision.models.get_model(name, **kwargs)


def input_for(name: str) -> torch.Tensor:
    size = 80 if name == "inception_v3" else (224 if name.startswith("maxvit") else 64)
    return torch.randn(2, 3, size, size)


def sync_then_revert(model: nn.Module) -> nn.Module:
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    return TorchSyncBatchNorm().revert(nn.SyncBatchNorm.convert_sync_batchnorm(model))


def check_model(name: str, ddp: bool) -> None:
    model = build(name)
    if ddp:
        model = sync_then_revert(model)
        assert any(type(m).__name__ == "_BatchNormXd" for m in model.modules())
    randomize_batchnorms(model, seed=1)
    model.eval()
    x = input_for(name)
    expected = foldable_after_conv(model)
    assert expected, f"{name}: no BN after a conv found; the check would be vacuous"
    before = fingerprint(model)
    result = fuse(model, example_inputs=x)
    assert fingerprint(model) == before
    left = {r.node for r in result.report.remaining_batchnorms}
    assert not (expected & left), f"{name}: BNs after a single-use conv left unfused: {sorted(expected & left)}"
    assert result.report.batchnorms_folded >= len(expected)
    assert count_batchnorms(result.graph_module) == result.report.after.batchnorms
    with torch.no_grad():
        out = result.graph_module(x)
    del result  # the fused copy goes before the fp64 one comes: regnet_y_128gf peaks ~5 GB lower
    gc.collect()
    ref = reference_fp64(model, (x,))
    as_fp32 = map_leaves(lambda t: t.float() if t.is_floating_point() else t, ref)  # the model's own dtype
    mismatch = structure_mismatch(out, as_fp32)
    assert mismatch is None, f"{name}: the fused outputs have another structure: {mismatch}"
    err = rel_err(out, ref)
    assert err <= 1e-5, f"{name}: relative error {err:.2e}"


HUGE = {"regnet_y_128gf"}


@contextlib.contextmanager
def one_at_a_time(name: str):
    """Across xdist workers, let only one huge model's test run at a time (memory, not correctness)."""
    if name not in HUGE:
        yield
        return
    with open(Path(tempfile.gettempdir()) / "fx_lightning_huge_model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.mark.parametrize("ddp", [False, True], ids=["as_built", "sync_reverted"])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_representatives(name, ddp):
    check_model(name, ddp)


@pytest.mark.parametrize("ddp", [False, True], ids=["as_built", "sync_reverted"])
@pytest.mark.parametrize("name", [n for n in _all_bn_models() if n not in FAMILIES])
def test_every_other_bn_model(name, ddp):
    if os.environ.get("FXL_SKIP_HUGE") and name in HUGE:
        pytest.skip(f"{name} needs ~9 GB; FXL_SKIP_HUGE is set")
    with one_at_a_time(name):
        check_model(name, ddp)
