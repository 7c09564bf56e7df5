"""Time-series, speech and tabular models (tests/zoo_sequence_models.py), random weights and randomised BatchNorm
statistics, fused in both capture forms and judged against an fp64 eval copy: the output's structure and
relative error, every BatchNorm an exact fold exists for folded (the count by hand in the zoo), and every one left
with a reason that names what blocks it on each side."""

from __future__ import annotations

import copy
from typing import Any, List

import pytest
import torch
from torch import nn

from fusion_helpers import count_bn_modules, fingerprint, randomize_batchnorms, rel_err
from zoo_sequence_models import SEQUENCE_ZOO
from fx_lightning import fuse
from fx_lightning.common.batches import flat_tensors
from fx_lightning.parity.compare import structure_mismatch

# What stands in the way of a fold, in the words of the reasons: each side of every BatchNorm left names one.
BEFORE = ("is not linear", "a sum of branches", "a concatenation of values", "a model input",
          "spread each output feature", "also feeds", "is pooled")
AFTER = ("a nonlinearity", "a residual add beside another branch", "a product with another value",
         "statistics that are not linear", "mixes several BatchNorm channels", "pads its input with zeros",
         "padding with a constant", "the model's output", "averages values of several channels")


def _to64(x: torch.Tensor) -> torch.Tensor:
    return x.double() if x.is_floating_point() else x


def _errors(model: nn.Module, fused: nn.Module, inputs: tuple) -> float:
    with torch.no_grad():
        out, base = fused(*inputs), model(*inputs)
        mismatch = structure_mismatch(out, base)
        assert mismatch is None, f"the fused model's outputs have another structure: {mismatch}"
        ref = copy.deepcopy(model).double()(*(_to64(x) for x in inputs))
    pairs = list(zip(flat_tensors(out), flat_tensors(ref)))
    assert pairs and len(pairs) == len(flat_tensors(base))
    return max(rel_err(o, r) for o, r in pairs)


def _sides(reason: str) -> List[str]:
    assert reason.startswith("no exact fold: before it, ") and "; after it, " in reason, reason
    return reason[len("no exact fold: before it, "):].split("; after it, ", 1)


@pytest.mark.parametrize("mode", ["auto", "export"])
@pytest.mark.parametrize("name", sorted(SEQUENCE_ZOO))
def test_sequence_model_folds_every_batchnorm_that_folds_exactly(name: str, mode: str) -> None:
    entry = SEQUENCE_ZOO[name]
    model, inputs = entry.build()
    randomize_batchnorms(model).eval()
    total = count_bn_modules(model)
    before = fingerprint(model)
    result = fuse(model, {"trace": {"mode": mode}}, example_inputs=inputs)
    assert fingerprint(model) == before, "fuse() changed its input module"
    err = _errors(model, result.graph_module, inputs)
    assert err <= 1e-5, f"relative error {err:.2e}\n{result.report}"
    report = result.report
    assert report.before.batchnorms == total
    assert report.batchnorms_folded == entry.foldable, str(report)
    left = report.remaining_batchnorms
    assert len(left) == report.after.batchnorms == total - entry.foldable
    for record in left:
        before_side, after_side = _sides(record.reason)
        assert any(words in before_side for words in BEFORE), record.reason
        assert any(words in after_side for words in AFTER), record.reason


def test_the_sequence_zoo_has_what_the_issue_asks_for() -> None:
    """A patch forecaster, a time x feature mixer, a TCN, a 1-d ResNet, ECAPA with reflect padding and
    Dropout1d(p=0), a Conformer convolution module, a tabular MLP; folds through layout operations among them."""
    wanted = {"patchtst_postnorm", "tsmixer", "tcn", "resnet1d", "ecapa_tdnn", "conformer", "tabular"}
    assert wanted <= set(SEQUENCE_ZOO)
    model, _ = SEQUENCE_ZOO["ecapa_tdnn"].build()
    assert any(isinstance(m, nn.Dropout1d) and m.p == 0 for m in model.modules())
    totals = [count_bn_modules(entry.build()[0]) for entry in SEQUENCE_ZOO.values()]
    assert sum(totals) >= 50 and sum(e.foldable for e in SEQUENCE_ZOO.values()) >= 30


def _left_reasons(name: str) -> List[Any]:
    model, inputs = SEQUENCE_ZOO[name].build()
    return fuse(randomize_batchnorms(model).eval(), example_inputs=inputs).report.remaining_batchnorms


def test_ecapa_names_the_residual_add_the_gate_and_the_pooling() -> None:
    text = "\n".join(r.reason for r in _left_reasons("ecapa_tdnn"))
    assert "a residual add beside another branch" in text
    assert "a product with another value" in text  # the SE gate
    assert "statistics that are not linear" in text  # the attentive statistics pooling


class _Prediction(nn.Module):
    """A Hugging Face time-series model called as a plain module: past values in, the forecast out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, past_values: torch.Tensor) -> torch.Tensor:
        return self.model(past_values, return_dict=True).prediction_outputs


def _hf_patchtst() -> nn.Module:
    import transformers

    return transformers.PatchTSTForPrediction(transformers.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=16, num_attention_heads=2,
        num_hidden_layers=2, ffn_dim=32, prediction_length=6, norm_type="batchnorm"))


def _hf_patchtsmixer() -> nn.Module:
    import transformers

    return transformers.PatchTSMixerForPrediction(transformers.PatchTSMixerConfig(
        context_length=32, patch_length=8, patch_stride=8, num_input_channels=3, d_model=16, num_layers=2,
        prediction_length=6, norm_mlp="BatchNorm", gated_attn=True))


# (build, BatchNorms, foldable by hand): PatchTST's default pre-norm layers give each BatchNorm (between transposes)
# only to W_Q/W_K/W_V or the FFN; PatchTSMixer's feature-mixing norms feed only their MLP's first Linear, while its
# patch-mixing norms feed a Linear over patches (the channel mixed) and follow a Linear that also feeds the residual.
LIBRARY_MODELS = {"transformers/PatchTST": (_hf_patchtst, 4, 4), "transformers/PatchTSMixer": (_hf_patchtsmixer, 4, 2)}


@pytest.mark.parametrize("name", sorted(LIBRARY_MODELS))
def test_library_time_series_models_fold_what_folds_exactly(name: str) -> None:
    pytest.importorskip("transformers")
    build, total, foldable = LIBRARY_MODELS[name]
    torch.manual_seed(0)
    model = _Prediction(randomize_batchnorms(build()).eval()).eval()
    x = torch.randn(2, 32, 3, generator=torch.Generator().manual_seed(1))
    result = fuse(model, example_inputs=x)
    err = _errors(model, result.graph_module, (x,))
    assert err <= 1e-5, f"relative error {err:.2e}"
    report = result.report
    assert (report.before.batchnorms, report.batchnorms_folded) == (total, foldable), str(report)
    for record in report.remaining_batchnorms:
        before_side, after_side = _sides(record.reason)
        assert any(words in before_side for words in BEFORE), record.reason
        assert any(words in after_side for words in AFTER), record.reason
