"""Never a wrong or broken answer (issue 36): one test per defect, each failing on cb4e1ca.

    item  defect                                                         test
    1     the low-precision gate lifted by outputs it does not compare   test_low_precision_gate_own_error_is_measured_on_compared_outputs_only
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fx_lightning.parity.gate import judge_parity, measure_parity


class _NoisyHead(nn.Module):
    """A model with a value output, an output drawn at random in eval and a discrete output (labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor):
        y = self.linear(x)
        return y, y + torch.randn_like(y), y.argmax(-1)


class _Scaled(nn.Module):
    """The reference with its value output wrong by 50%."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor):
        y, noisy, labels = self.model(x)
        return y * 1.5, noisy, labels


def test_low_precision_gate_own_error_is_measured_on_compared_outputs_only() -> None:
    torch.manual_seed(0)
    model = _NoisyHead().eval().to(torch.bfloat16)
    precise = copy.deepcopy(model).double()
    batches = [torch.randn(16, 8).to(torch.bfloat16) for _ in range(3)]
    cfg = {"rtol": 1e-4, "min_discrete_agreement": 0.0}

    def run(candidate: nn.Module):
        state = measure_parity(model, candidate, batches, cfg, precise_reference=precise, stochastic=[1])
        return judge_parity(state, cfg)

    wrong = run(_Scaled(model))
    own = wrong.metrics["reference_error_vs_fp64"]
    # The bf16 value output's own error against fp64 is bf16 rounding, not the noise of the drawn output.
    assert own < 0.05, own
    assert wrong.thresholds["relative_max_error"] <= max(1e-4, 4 * own) < 0.2
    assert not wrong.passed and any("relative_max_error" in str(f) for f in wrong.failures)
    assert run(model).passed
