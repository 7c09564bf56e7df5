"""Parity per output (issue 41): each output of the model with its relative error and the distribution of its
samples' errors, in the manifest (round trip) and in report.html (a table and a plot per output)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_helpers import TwoHeads, fp64_copy
from fx_lightning import FuseConfig, fuse_and_export, load_fused
from fx_lightning.config.schema import ExportFormat
from fx_lightning.export import read_manifest
from fx_lightning.export.write.report_html import figures, render_report
from fx_lightning.parity.report import OutputError, ParityReport


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, object]:
    torch.manual_seed(0)
    model = TwoHeads(score_scale=100.0).eval()  # outputs of different scales
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(6, 3, 12, 12, generator=g) for _ in range(3)]
    cfg = FuseConfig()
    cfg.export.formats = [ExportFormat("graph_module")]
    directory = tmp_path_factory.mktemp("outputs") / "export"
    fuse_and_export(model, directory, batches=batches, config=cfg)
    return {"model": model, "batches": batches, "dir": directory}


def _direct(model: nn.Module, fused: nn.Module, batches: List[torch.Tensor]) -> List[List[float]]:
    """Each output's samples' errors, computed here: the fused model against an fp64 copy of the original, over
    the output's max|reference| on every batch."""
    precise = fp64_copy(model)
    with torch.no_grad():
        pairs = [(fused(x), precise(x.double())) for x in batches]
    out = []
    for i in range(2):
        diffs = torch.cat([(f[i].double() - r[i]).abs().amax(dim=1) for f, r in pairs])
        scale = max(float(r[i].abs().max()) for _, r in pairs)
        out.append((diffs / scale).tolist())
    return out


def test_each_output_has_its_error_and_distribution_matching_a_direct_computation(exported: Dict[str, object]
                                                                                  ) -> None:
    manifest = read_manifest(exported["dir"])
    parity = manifest.parity
    assert parity is not None and parity.passed
    outputs = parity.outputs
    names = [leaf["name"] for leaf in manifest.to_dict()["outputs"]]  # the signature's names
    assert [o.name for o in outputs] == names and len(outputs) == 2
    fused = load_fused(exported["dir"])
    direct = _direct(exported["model"], fused, exported["batches"])
    for out, errors in zip(outputs, direct):
        assert out.samples == len(errors) == 18 and out.shape == [6, out.shape[1]]
        assert set(out.quantiles) == {"p50", "p90", "p99", "max"}
        assert out.quantiles["max"] == out.relative_max_error
        assert out.quantiles["p50"] <= out.quantiles["p90"] <= out.quantiles["p99"] <= out.quantiles["max"]
        # Parity compares with the fp32 original, this with an fp64 copy: the same size, within rounding.
        assert 0 < out.relative_max_error < 1e-5 and max(errors) / 10 < out.relative_max_error < max(errors) * 10
        ordered = sorted(errors)
        assert ordered[len(ordered) // 2] / 10 < out.quantiles["p50"] < ordered[len(ordered) // 2] * 10 + 1e-12
        assert sum(out.counts) + out.zeros == out.samples and len(out.edges) == len(out.counts) + 1
    # The whole-model figure is the worst pooled over the outputs; each output is relative to its own scale.
    assert max(o.relative_max_error for o in outputs) >= parity.metrics["relative_max_error"] * 0.999


def test_the_per_output_errors_round_trip_and_old_manifests_still_load(exported: Dict[str, object]) -> None:
    parity = read_manifest(exported["dir"]).parity
    assert parity is not None and parity.outputs
    again = ParityReport.from_dict(json.loads(json.dumps(parity.to_dict())))
    assert again == parity and all(isinstance(o, OutputError) for o in again.outputs)
    old = parity.to_dict()
    del old["outputs"]
    assert ParityReport.from_dict(old).outputs == []
    nan = OutputError("y", float("nan"), 1, {"max": float("inf")})
    back = OutputError.from_dict(json.loads(json.dumps(nan.to_dict())))  # JSON has no NaN: strings, read back
    assert back.quantiles == {"max": float("inf")} and back.relative_max_error != back.relative_max_error


def test_the_report_shows_each_output_with_its_figures_and_a_plot(exported: Dict[str, object]) -> None:
    manifest = read_manifest(exported["dir"])
    page = render_report(manifest)
    shown = figures(manifest)
    for out in manifest.parity.outputs:
        assert f'data-plot="parity.output.{out.name}"' in page
        key = f"parity.output.{out.name}.relative_max_error"
        assert shown[key] == out.relative_max_error
        assert f'data-key="{key}" data-value="{out.relative_max_error!r}"' in page
        for q, value in out.quantiles.items():
            assert f'data-key="parity.output.{out.name}.{q}" data-value="{value!r}"' in page
        bars = page.split(f'data-plot="parity.output.{out.name}"')[1].split("</svg>")[0]
        assert bars.count("<rect") == len(out.counts) + (1 if out.zeros else 0)
        assert sum(int(c.split('"')[0]) for c in bars.split('data-count="')[1:]) == out.samples
    assert "<script" not in page
