"""compare_outputs: the one answer to "does this output match its reference?" (capture, module checks, export
round trip, selection, parity gate): structure first (count, nesting, shapes, dtypes), then relative error."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from fx_lightning.parity.compare import compare_outputs
from fx_lightning.common.tolerance import ROUNDING_RTOL, RUNTIME_FACTOR, rounding_tolerance


def test_equal_outputs_pass_with_their_dtypes_rounding() -> None:
    want = (torch.randn(2, 3), {"a": torch.randn(4)})
    got = (want[0] * (1 + 5e-6), {"a": want[1]["a"].clone()})
    result = compare_outputs(got, want)
    assert result.passed and result.outputs == 2 and result.tolerance == ROUNDING_RTOL[torch.float32]
    assert 0 < result.relative_error < 1e-5


def test_relative_error_is_against_the_references_scale() -> None:
    want = torch.tensor([1000.0, 1.0])
    got = torch.tensor([1000.0, 1.5])  # 0.5 off where the scale is 1000: 5e-4 relative
    result = compare_outputs(got, want)
    assert result.relative_error == pytest.approx(5e-4)
    assert not result.passed and "differs from the reference by 0.0005" in result.describe()
    assert compare_outputs(got, want, rtol=1e-3).passed


@pytest.mark.parametrize("got, want, fragment", [
    ((torch.ones(2),), (torch.ones(2), torch.ones(2)), "1 tensor(s), the reference 2"),
    ([torch.ones(2), [torch.ones(2)]], [[torch.ones(2)], torch.ones(2)], "is a tensor, the reference's is a sequence"),
    ({"a": torch.ones(1)}, {"b": torch.ones(1)}, "has keys ['a'], the reference's ['b']"),
    (torch.ones(2, 3), torch.ones(3, 2), "output 0 has shape (2, 3), the reference's (3, 2)"),
    (torch.ones(2), torch.ones(2, dtype=torch.float64), "output 0 is float32, the reference's float64"),
])
def test_structure_mismatches_are_named(got: object, want: object, fragment: str) -> None:
    result = compare_outputs(got, want)
    assert not result.passed and result.relative_error == float("inf")
    assert result.mismatch is not None and fragment in result.mismatch


def test_flat_comparison_ignores_nesting_only() -> None:
    want = {"logits": torch.ones(2, 3), "aux": [torch.zeros(2)]}
    got = (torch.ones(2, 3), torch.zeros(2))  # a runtime (ONNX Runtime) returns its outputs flat
    assert not compare_outputs(got, want).passed
    assert compare_outputs(got, want, nested=False).passed


def test_named_tuples_and_dataclass_outputs_are_compared_by_their_fields() -> None:
    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        hidden: torch.Tensor

    x = torch.randn(3)
    assert compare_outputs(Pair(x, x), (x, x)).passed  # a named tuple is a sequence
    assert compare_outputs(Output(x, x), {"logits": x, "hidden": x}).passed
    assert not compare_outputs(Output(x, x), {"logits": x, "hidden": x + 1}).passed


def test_nans_must_sit_where_the_reference_has_them() -> None:
    want = torch.tensor([1.0, float("nan"), 3.0])
    assert compare_outputs(want.clone(), want).passed
    moved = torch.tensor([float("nan"), 2.0, 3.0])
    result = compare_outputs(moved, want)
    assert not result.passed and "NaNs or infinities where the reference has none" in result.describe()


def test_infinities_equal_to_the_references_are_equal() -> None:
    """A masked logit's -inf equals itself (as numbers inf - inf is NaN: a model differed from itself); an infinity
    of the other sign, or where the reference has a number, does not."""
    want = torch.tensor([1.0, float("-inf"), 3.0])
    assert compare_outputs(want.clone(), want).passed
    assert not compare_outputs(torch.tensor([1.0, float("inf"), 3.0]), want).passed
    assert not compare_outputs(torch.tensor([float("-inf"), 2.0, 3.0]), want).passed


def test_integer_outputs_must_be_equal() -> None:
    want = torch.tensor([1, 2, 3])
    assert compare_outputs(want.clone(), want).passed
    assert not compare_outputs(torch.tensor([1, 2, 4]), want).passed


def test_an_artifacts_tolerance_grows_with_the_fused_models_own_error() -> None:
    assert rounding_tolerance(torch.float32) == 1e-5
    assert rounding_tolerance(torch.float32, own_error=1e-5) == pytest.approx(RUNTIME_FACTOR * 1e-5)
    assert rounding_tolerance(torch.bfloat16) == 2e-2
    want = torch.ones(4)
    got = want * (1 + 5e-5)
    assert not compare_outputs(got, want).passed
    assert compare_outputs(got, want, own_error=1e-5).passed


def test_a_float_output_at_0_and_1_in_the_reference_only_is_judged_by_value() -> None:
    """Held-out check 8 (a NeRF's opacity, the sum of the ray weights): exactly 1 or 0 in fp64, within 2e-7 of it in
    fp32. It was taken for a thresholded output and judged by agreement (0% of the elements equal), so every format
    was refused after training. A thresholded output gives 0 and 1 at any precision: one that does not is judged by
    its relative error, and a discrete one is still judged by agreement."""
    want = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64).float()  # cast to the artifact's dtype, as checked
    got = torch.tensor([1 - 6e-8, 0.0, 1 - 1.2e-7, 1.0], dtype=torch.float32)
    result = compare_outputs(got, want, min_agreement=0.999)
    assert result.failure is None and result.relative_error < 2e-7, result
    assert compare_outputs(got * 0.9, want, min_agreement=0.999).failure is not None  # off by 10%: refused
    flipped = torch.tensor([1.0, 0.0, 0.0, 1.0])  # a thresholded output that flips one element
    assert "agrees with the reference on 75.0000%" in compare_outputs(flipped, want, min_agreement=0.999).failure


def test_a_lossy_output_at_0_and_1_in_the_reference_keeps_the_agreement() -> None:
    """Judged by value, an output at 0 and 1 in the reference only would pass anything within a lossy tolerance
    (as large as the output itself): there it is judged by agreement, as before (review of the ninth session)."""
    want = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    failure = compare_outputs(torch.full((2, 2), 0.5), want, rtol=1.0, min_agreement=0.99).failure
    assert failure is not None and "agrees with the reference on 0.0000%" in failure
