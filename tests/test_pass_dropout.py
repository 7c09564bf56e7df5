"""remove_dropout: every Dropout module variant and functional dropout that is inactive in eval mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_helpers import assert_exact, dropout_nodes, fingerprint
from fx_lightning import fuse


@pytest.mark.parametrize(
    "layer",
    [nn.Dropout(0.3), nn.Dropout1d(0.3), nn.Dropout2d(0.3), nn.Dropout3d(0.3), nn.AlphaDropout(0.3),
     nn.FeatureAlphaDropout(0.3)],
    ids=lambda m: type(m).__name__,
)
def test_every_dropout_module_is_removed(layer):
    # Dropout1d wants (N, C, L); the others take the 5-D activations of a Conv3d.
    conv, x = (nn.Conv1d(2, 4, 1), torch.randn(2, 2, 5)) if isinstance(layer, nn.Dropout1d) else (
        nn.Conv3d(2, 4, 1), torch.randn(2, 2, 3, 3, 3))
    model = nn.Sequential(conv, layer, nn.ReLU())
    model.train()  # the input's mode must not matter, nor change
    before = fingerprint(model)
    result = fuse(model)
    assert fingerprint(model) == before
    assert dropout_nodes(result.graph_module) == 0
    assert result.report.before.dropouts == 1 and result.report.after.dropouts == 0
    assert_exact(model, result.graph_module, (x,))


class FunctionalDropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(self.lin(x), 0.5, training=self.training)
        x = F.alpha_dropout(x, 0.2, self.training)
        x = F.feature_alpha_dropout(x, 0.2, training=self.training)
        x = F.dropout1d(x.unsqueeze(0), 0.1, training=self.training).squeeze(0)
        return x


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_functional_dropout_with_training_flag_is_removed(mode):
    model = FunctionalDropouts()
    x = torch.randn(3, 4)
    result = fuse(model, {"trace": {"mode": mode}}, example_inputs=x)
    removed = result.report.pass_report("remove_dropout").changed
    assert dropout_nodes(result.graph_module) == 0, str(result.report)
    assert len(removed) >= (4 if mode == "fx" else 1)
    assert_exact(model, result.graph_module, (x,))


class ActiveDropout(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5)  # training=True by default: active even in eval mode


def test_active_functional_dropout_is_left_with_reason():
    result = fuse(ActiveDropout())
    skipped = result.report.pass_report("remove_dropout").skipped
    assert dropout_nodes(result.graph_module) == 1
    assert "active even in eval mode" in skipped[0].reason
    forced = fuse(ActiveDropout(), {"passes": {"remove_dropout": {"remove_active_functional": True}}})
    assert dropout_nodes(forced.graph_module) == 0


def test_remove_dropout_can_be_disabled():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.1))
    result = fuse(model, {"passes": {"remove_dropout": {"enabled": False}}})
    assert dropout_nodes(result.graph_module) == 1
    assert "remove_dropout" not in [p.name for p in result.report.passes]


@pytest.mark.parametrize(
    "layer, shape",
    [(nn.Dropout(0.3), (2, 4, 5)), (nn.Dropout1d(0.0), (2, 4, 5)), (nn.Dropout1d(0.3), (2, 4, 5)),
     (nn.Dropout2d(0.3), (2, 4, 5, 5)), (nn.Dropout3d(0.3), (2, 4, 3, 3, 3)), (nn.AlphaDropout(0.3), (2, 4)),
     (nn.FeatureAlphaDropout(0.3), (2, 4, 3, 3))],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "x",
)
def test_every_dropout_module_is_removed_from_an_export_graph(layer, shape):
    """torch.export records eval-mode Dropout1d/2d/3d as aten.feature_dropout, AlphaDropout as aten.alpha_dropout
    (p=0 too): each is counted and removed like aten.dropout."""
    model = nn.Sequential(nn.Conv1d(4, 4, 1) if len(shape) == 3 else nn.Identity(), layer, nn.ReLU())
    x = torch.randn(*shape)
    result = fuse(model, {"trace": {"mode": "export"}}, example_inputs=x)
    assert result.report.before.dropouts == 1, str(result.report)
    assert dropout_nodes(result.graph_module) == 0 and result.report.after.dropouts == 0
    assert_exact(model, result.graph_module, (x,))


class FunctionalFeatureDropouts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout1d(x, 0.5, training=self.training)
        x = torch.feature_dropout(x, 0.3, self.training)
        x = F.feature_alpha_dropout(x, 0.2, training=self.training)
        return F.alpha_dropout(x, 0.2, self.training) * 2


def test_functional_feature_dropouts_are_removed_from_an_export_graph():
    x = torch.randn(2, 4, 5)
    result = fuse(FunctionalFeatureDropouts(), {"trace": {"mode": "export"}}, example_inputs=x)
    assert result.report.before.dropouts == 4 and dropout_nodes(result.graph_module) == 0, str(result.report)
    assert_exact(FunctionalFeatureDropouts(), result.graph_module, (x,))
