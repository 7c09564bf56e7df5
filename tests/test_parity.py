"""fx_lightning.parity on its own: input extraction, the torchmetrics measurements and the gate."""

from __future__ import annotations

import json
import math
from typing import Any, List

import pytest
import torch
from torch import nn

import lightning_helpers as H
from fx_lightning import ConfigError, fuse
from fx_lightning.common.batches import extract_input, extract_labels
from fx_lightning.parity import ParityReport, RelativeMaxError
from fx_lightning.parity.gate import check_parity
from fx_lightning.common.notes import TEXT
from fx_lightning.parity.gate import GATE_MISSED, NO_BATCHES, OUTPUT_STRUCTURE


def pick_second(batch: Any) -> Any:
    """Used by import-path input rules below."""
    return batch[1]


class Scaled(nn.Module):
    """``f(x) * factor (+ offset)``: a candidate that is off by a known amount."""

    def __init__(self, inner: Any, factor: float = 1.0, offset: float = 0.0) -> None:
        super().__init__()
        self.inner, self.factor, self.offset = inner, factor, offset

    def forward(self, *args: Any) -> Any:
        return self.inner(*args) * self.factor + self.offset


# ------------------------------------------------------------------------------------- extract_input


def test_extract_input_automatic_rules() -> None:
    x, y = torch.randn(2, 3), torch.tensor([1, 2])
    assert extract_input(x) is x
    assert extract_input((x, y)) is x
    assert extract_input([x, y]) is x
    for key in ("x", "input", "image", "images"):
        assert extract_input({key: x, "label": y}) is x
    pair = ((x, x), y)
    assert extract_input(pair) == (x, x)  # a tuple is several positional arguments


def test_extract_input_configured_rules() -> None:
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    assert extract_input({"pixels": x}, "pixels") is x
    assert extract_input((x, y), 1) is y
    assert extract_input((x, y), "1") is y
    assert extract_input((x, y), "test_parity:pick_second") is y
    assert extract_input((x, y), lambda b: b[1] * 2).equal(y * 2)


@pytest.mark.parametrize(
    "batch, rule, expected",
    [
        ({"pixels": torch.zeros(1)}, None, "pixels"),  # automatic: names the keys it has
        ({"x": torch.zeros(1)}, "img", "'img' is not in the batch"),
        ((torch.zeros(1),), 3, "out of range"),
        (torch.zeros(1), 0, "is an index"),
        ("text", None, "str"),
        ((torch.zeros(1),), "no_such_module_xyz:fn", "cannot import"),
    ],
)
def test_extract_input_errors_name_parity_input(batch: Any, rule: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        extract_input(batch, rule)
    assert "parity.input" in str(info.value)
    assert expected in str(info.value)


def test_extract_labels_only_integer_tensors() -> None:
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 3])
    assert extract_labels((x, y)) is y
    assert extract_labels({"image": x, "label": y}) is y
    assert extract_labels((x, torch.randn(4))) is None  # regression targets are not labels
    assert extract_labels(x) is None


def test_the_labels_are_the_batch_item_whose_values_are_classes_of_the_scores() -> None:
    """A text batch ``(tokens, lengths, labels)``: its second item was taken as the labels, so lengths 5..19
    ruled the 4-wide output out as class scores and no accuracy was measured (nor gated, for a lossy variant)."""
    labels = torch.arange(10) % 4
    logits = torch.nn.functional.one_hot(labels, 4).float() * 4
    worse = logits.clone()
    worse[:3] = torch.roll(worse[:3], 1, dims=1)  # 3 of 10 now wrong
    lengths = torch.arange(5, 15)
    report = check_parity(Logits(), lambda x: worse, [(logits, lengths, labels)], {"min_top1_agreement": 0})
    assert report.metrics["accuracy_reference"] == 1.0
    assert report.metrics["accuracy_fused"] == pytest.approx(0.7)
    assert not [n for n in report.notes if "not the labels' classes" in str(n)]


def test_labels_that_fit_no_candidate_still_rule_the_output_out_as_scores() -> None:
    """When no integer item of the batch holds classes of the scores, the first still shows they are not scores."""
    logits = torch.randn(10, 4)
    report = check_parity(Logits(), lambda x: logits, [(logits, torch.arange(5, 15), torch.arange(10, 20))])
    assert "accuracy_fused" not in report.metrics
    assert [n for n in report.notes if "not the labels' classes" in str(n)]


# ---------------------------------------------------------------------------------------- the metrics


def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)).eval()


def _batches(n: int = 3, bs: int = 8) -> List[Any]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(bs, 3, 8, 8, generator=g), torch.randint(0, 5, (bs,), generator=g)) for _ in range(n)]


def test_identical_models_pass_with_exact_figures() -> None:
    model = _conv_model()
    report = check_parity(model, model, _batches(), {"max_batches": 2})
    assert report.passed, report.failures
    assert report.batches == 2
    assert report.metrics["relative_max_error"] == 0.0
    assert report.metrics["mean_absolute_error"] == 0.0
    assert report.metrics["cosine_similarity_min"] == pytest.approx(1.0, abs=1e-12)
    assert report.metrics["top1_agreement"] == 1.0
    assert report.metrics["accuracy_drop"] == 0.0
    assert report.metrics["samples"] == 16.0


def test_relative_error_matches_a_hand_computation_and_fails_the_gate() -> None:
    model = _conv_model()
    candidate = Scaled(model, factor=1.01)
    batches = _batches()
    report = check_parity(model, candidate, batches, {"rtol": 1e-4})
    with torch.no_grad():
        refs = torch.cat([model(x) for x, _ in batches]).double()
        cands = torch.cat([candidate(x) for x, _ in batches]).double()
    expected = ((cands - refs).abs().max() / refs.abs().max()).item()
    assert report.metrics["relative_max_error"] == pytest.approx(expected, rel=1e-9)
    assert report.metrics["mean_absolute_error"] == pytest.approx((cands - refs).abs().mean().item(), rel=1e-9)
    assert not report.passed
    failure = next(f for f in report.failures if f.kind == GATE_MISSED and f["metric"] == "relative_max_error")
    assert failure["key"] == "parity.rtol" and failure["threshold"] == 0.0001
    assert failure["value"] == pytest.approx(expected, rel=1e-9)


def test_gate_is_relative_to_the_reference_scale() -> None:
    # Outputs of magnitude 1e6 with float32-level relative differences: large absolute error, still a pass.
    big = Scaled(_conv_model(), factor=1e6)
    candidate = Scaled(big, factor=1 + 2e-7)
    report = check_parity(big, candidate, _batches())
    assert report.metrics["mean_absolute_error"] > 1e-3
    assert report.metrics["relative_max_error"] < 1e-6
    assert report.passed, report.failures


def test_channels_last_and_float16_outputs_are_measured() -> None:
    # torchmetrics' MAE uses .view(-1) (fails on channels_last) and does not upcast float16.
    conv = nn.Conv2d(3, 4, 3).eval()
    ref = lambda x: conv(x).to(memory_format=torch.channels_last).half()  # noqa: E731
    cand = lambda x: (conv(x) + 1e-3).to(memory_format=torch.channels_last).half()  # noqa: E731
    ref_mod = nn.Module()
    ref_mod.forward = ref  # type: ignore[method-assign]
    batches = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    report = check_parity(ref_mod, cand, batches, {"rtol": 1.0})
    with torch.no_grad():
        diffs = torch.cat([(cand(x).double() - ref(x).double()).abs().reshape(-1) for x in batches])
    assert report.metrics["mean_absolute_error"] == pytest.approx(diffs.mean().item(), rel=1e-9)
    assert report.metrics["mean_absolute_error"] > 5e-4  # the 1e-3 offset, not float16 underflow


class Logits(nn.Module):
    """The input *is* the logits: lets a test dictate every prediction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_top1_agreement_is_micro_averaged() -> None:
    # 9 samples of class 0 and one of class 1; the candidate flips the class-1 sample.
    logits = torch.zeros(10, 3)
    logits[:9, 0] = 5.0
    logits[9, 1] = 5.0
    flipped = logits.clone()
    flipped[9] = torch.tensor([5.0, 0.0, 0.0])
    report = check_parity(Logits(), lambda x: flipped, [logits])
    # macro averaging would give (1.0 + 0.0) / 2 = 0.5
    assert report.metrics["top1_agreement"] == pytest.approx(0.9)
    assert not report.passed
    assert any(f.kind == GATE_MISSED and f["metric"] == "top1_agreement" and f["value"] == pytest.approx(0.9)
               and f["key"] == "parity.min_top1_agreement" for f in report.failures), report.failures


def test_near_ties_do_not_count_as_disagreement() -> None:
    logits = torch.tensor([[1.0, 1.0 - 1e-9, 0.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    swapped = logits.clone()
    swapped[0] = torch.tensor([1.0 - 1e-9, 1.0, 0.0], dtype=torch.float64)
    report = check_parity(Logits(), lambda x: swapped, [logits])
    assert report.metrics["top1_agreement_strict"] == 0.5
    assert report.metrics["top1_agreement"] == 1.0
    assert report.passed, report.failures


def test_accuracy_drop_against_labels() -> None:
    labels = torch.arange(10) % 4
    logits = torch.nn.functional.one_hot(labels, 4).float() * 4
    worse = logits.clone()
    worse[:3] = torch.roll(worse[:3], 1, dims=1)  # 3 of 10 now wrong
    report = check_parity(Logits(), lambda x: worse, [(logits, labels)], {"min_top1_agreement": 0})
    assert report.metrics["accuracy_reference"] == 1.0
    assert report.metrics["accuracy_fused"] == pytest.approx(0.7)
    assert report.metrics["accuracy_drop"] == pytest.approx(0.3)
    drops = [f for f in report.failures if f.kind == GATE_MISSED and f["metric"] == "accuracy_drop"]
    assert len(drops) == 1, report.failures
    assert drops[0]["value"] == pytest.approx(0.3) and drops[0]["relation"] == ">"
    assert drops[0]["key"] == "parity.max_accuracy_drop" and drops[0]["threshold"] == 0.001


def test_nan_output_fails_and_report_stays_json_safe() -> None:
    model = _conv_model()
    report = check_parity(model, Scaled(model, factor=float("nan")), _batches(1))
    assert not report.passed
    assert math.isnan(report.metrics["relative_max_error"])
    text = json.dumps(report.to_dict(), allow_nan=False)
    assert json.loads(text)["passed"] is False


def test_no_batches_fails_with_a_reason() -> None:
    report = check_parity(_conv_model(), _conv_model(), [])
    assert not report.passed and report.batches == 0
    assert report.failures[0].kind == NO_BATCHES


def test_output_structure_mismatch_fails() -> None:
    model = _conv_model()
    report = check_parity(model, lambda x: (model(x), model(x)), _batches(1))
    assert not report.passed
    assert report.failures[0].kind == OUTPUT_STRUCTURE


def test_relative_max_error_metric_alone() -> None:
    metric = RelativeMaxError()
    metric.update(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    metric.update(torch.tensor([0.5]), torch.tensor([0.0]))
    assert metric.compute().item() == pytest.approx(2.0 / 4.0)
    zero = RelativeMaxError()
    zero.update(torch.tensor([1e-3]), torch.tensor([0.0]))
    assert math.isinf(zero.compute().item())


# ------------------------------------------------------------------------------------- whole models


def test_whole_models_compare_the_target_on_its_recorded_inputs() -> None:
    lit = H.randomize_batchnorms(H.LitClassifier()).eval()
    result = fuse(lit.backbone, example_inputs=torch.randn(4, 3, 8, 8))
    whole_candidate = nn.Module()
    whole_candidate.forward = lambda x: lit.head(result.graph_module(x))  # type: ignore[method-assign]
    data = [(x, y) for x, y in H.loaders()[1]]
    report = check_parity(lit.backbone, result.graph_module, data, whole_reference=lit,
                          whole_candidate=whole_candidate, source="val")
    assert report.passed, report.failures
    assert report.metrics["relative_max_error"] < 1e-5
    assert 0 < report.metrics["whole_relative_max_error"] < 1e-5
    assert report.metrics["samples"] == 32
    assert {"accuracy_reference", "accuracy_fused", "top1_agreement"} <= set(report.metrics)


def test_target_not_called_by_whole_model_is_an_error() -> None:
    lit = H.LitClassifier().eval()
    with pytest.raises(ConfigError, match="never called"):
        check_parity(nn.Linear(2, 2), nn.Linear(2, 2), [torch.randn(2, 3, 8, 8)], whole_reference=lit,
                     whole_candidate=lit)


def test_dict_config_and_defaults_are_validated() -> None:
    with pytest.raises(ConfigError, match="parity.rtol"):
        check_parity(_conv_model(), _conv_model(), _batches(1), {"rtol": -1})
    with pytest.raises(ConfigError, match="parity.rtl"):
        check_parity(_conv_model(), _conv_model(), _batches(1), {"rtl": 1})


def test_report_str_lists_figures_and_failures() -> None:
    failure = GATE_MISSED(metric="x", value=1, relation=">", key="y", threshold=0)
    report = ParityReport(passed=False, metrics={"relative_max_error": 0.5}, failures=[failure],
                          batches=2, source="train", notes=[TEXT(text="hello")])
    text = str(report)
    assert "FAILED" in text and "relative_max_error" in text and "FAIL: x = 1 > y = 0" in text and "train" in text
