"""Each lossy variant is declared once (``fx_lightning.variants.Variant``): its options under the config key it
declares, its calibration, its gate and what making it may fail with are read from that declaration."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.fx as fx
from torch import nn

from fusion_helpers import rel_err
from fx_lightning.config import FuseConfig, ParityConfig, load_config
from fx_lightning.errors import PassError
from fx_lightning.pipeline.steps import calibration_batch_count
from fx_lightning.variants import (BF16, INT8, VARIANTS, MadeVariant, Variant, VariantContext, VariantOptions,
                                   declare_variant, enabled_variants)


def test_each_variant_has_its_options_under_the_key_it_declares_and_is_off_by_default() -> None:
    passes = FuseConfig().passes
    assert list(VARIANTS) == ["int8", "bf16"]
    for variant in VARIANTS.values():
        options = getattr(passes, variant.key)
        assert type(options) is variant.options_type and not options.enabled
    assert enabled_variants(passes) == [] and calibration_batch_count(FuseConfig()) == 0


def test_the_calibration_count_is_the_enabled_variants_own() -> None:
    config = load_config(passes={"quantize_int8": {"enabled": True, "calibration_batches": 3},
                                 "cast_bf16": {"enabled": True}})
    assert [(v.name, type(o)) for v, o in enabled_variants(config.passes)] == [
        ("int8", INT8.options_type), ("bf16", BF16.options_type)]
    assert calibration_batch_count(config) == 3  # int8's calibration_batches; bf16 needs its example only
    bf16_only = load_config(passes={"cast_bf16": {"enabled": True}})
    assert calibration_batch_count(bf16_only) == 1


def test_a_variant_gate_is_the_parity_gate_with_its_own_thresholds() -> None:
    parity = ParityConfig(rtol=3e-4, max_batches=5)
    options = INT8.options_type(min_cosine=0.5, min_top1_agreement=0.75, max_accuracy_drop=0.25)
    gate = options.gate_of(parity)
    assert (gate.min_cosine, gate.min_top1_agreement, gate.max_accuracy_drop) == (0.5, 0.75, 0.25)
    assert (gate.rtol, gate.max_batches) == (3e-4, 5) and parity.min_cosine == ParityConfig().min_cosine


def test_a_name_or_key_is_declared_once() -> None:
    before = dict(VARIANTS)
    with pytest.raises(ValueError) as same_key:
        declare_variant(dataclasses.replace(INT8, name="int4"))
    assert "passes.quantize_int8" in str(same_key.value) and "'int8'" in str(same_key.value)
    with pytest.raises(ValueError):
        declare_variant(dataclasses.replace(BF16, key="cast_fp16"))
    assert VARIANTS == before


def _fused_graph() -> fx.GraphModule:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return fx.symbolic_trace(model.eval())


def test_making_a_variant_that_raises_or_makes_no_model_is_a_pass_error_naming_its_key() -> None:
    def raises(gm: fx.GraphModule, options: VariantOptions, ctx: VariantContext) -> MadeVariant:
        raise RuntimeError("boom")

    def no_model(gm: fx.GraphModule, options: VariantOptions, ctx: VariantContext) -> MadeVariant:
        return "not a model"  # type: ignore[return-value]

    ctx = VariantContext(example_inputs=(torch.randn(2, 3, 8, 8),))
    for make, fragment in ((raises, "passes.fp8_test raised RuntimeError: boom"), (no_model, "made str")):
        variant = Variant("fp8", "fp8_test", VariantOptions, make, frozenset(), "nothing", "emulated")
        with pytest.raises(PassError) as info:
            variant.build(_fused_graph(), VariantOptions(), ctx)
        assert fragment in str(info.value)
    with pytest.raises(PassError) as no_inputs:
        BF16.build(_fused_graph(), BF16.options_type(), VariantContext())
    assert "passes.cast_bf16: no inputs" in str(no_inputs.value)


def test_the_bf16_variant_keeps_the_fp32_interface_and_leaves_the_fused_graph_alone() -> None:
    gm = _fused_graph()
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    x = torch.randn(3, 3, 8, 8)
    made = BF16.build(gm, BF16.options_type(enabled=True), VariantContext(example_inputs=(x,)))
    reference = copy.deepcopy(gm).double()(x.double())
    out = made.model(torch.randn(5, 3, 8, 8))  # another batch size: exported with a dynamic sample axis
    assert out.shape == (5, 4) and out.dtype == torch.float32
    got = made.model(x)
    assert got.dtype == torch.float32 and got.shape == reference.shape
    assert rel_err(got, reference) < 2e-2  # bf16 keeps about 3 significant digits
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())
