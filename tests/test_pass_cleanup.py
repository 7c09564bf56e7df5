"""remove_identity and eliminate_dead_code."""

from __future__ import annotations

import torch
from torch import nn

from fusion_helpers import assert_exact, count_batchnorms, randomize_batchnorms
from fx_lightning import fuse


def test_identity_between_conv_and_bn_is_removed_so_bn_folds():
    model = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Identity(), nn.BatchNorm2d(4)))
    result = fuse(model)
    gm = result.graph_module
    assert not any(isinstance(m, nn.Identity) for m in gm.modules())
    assert count_batchnorms(gm) == 0
    assert result.report.pass_report("remove_identity").changed
    assert_exact(model, gm, (torch.randn(2, 3, 6, 6),))


class DeadBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _ = self.unused(x)  # computed and thrown away
        return self.used(x)


def test_dead_code_and_its_weights_are_dropped():
    model = DeadBranch()
    result = fuse(model)
    gm = result.graph_module
    assert not hasattr(gm, "unused")
    assert result.report.after.parameters == sum(p.numel() for p in model.used.parameters())
    assert result.report.after.nodes < result.report.before.nodes
    assert_exact(model, gm, (torch.randn(2, 4),))


def test_folded_weights_are_not_kept_twice():
    """After folding, the original conv weights and BN statistics must not stay attached to the module."""
    model = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)))
    result = fuse(model, {"trace": {"mode": "export"}}, example_inputs=torch.randn(2, 3, 5, 5))
    conv_numel = 8 * 3 * 3 * 3
    assert result.report.after.parameters == conv_numel + 8  # fused weight + new bias, nothing else
