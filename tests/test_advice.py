"""Every refusal's advice is tested: each error below tells the user what to set; the test provokes it, checks the
advice is in the message, applies exactly that advice and shows the run then works (numbers compared with an fp64
eval copy of the original, relative error). Advice that could not work was corrected or removed (the test shows the
corrected message).

One test per advice; the docstring names the error (file and what it says)."""

from __future__ import annotations

import ast
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_helpers import count_batchnorms, randomize_batchnorms, reference_fp64, rel_err
from fx_lightning import ConfigError, ExportError, TraceError, fuse
from fx_lightning.common.calls import Call

TOL = 1e-5


def assert_matches(model: nn.Module, fused: nn.Module, *inputs: object, tol: float = TOL) -> None:
    """``fused(*inputs)`` equals the fp64 eval copy of ``model`` to ``tol`` (relative to the output's scale)."""
    ref = reference_fp64(model, inputs)
    with torch.no_grad():
        out = fused(*inputs)
    refs, outs = (ref, out) if isinstance(ref, (tuple, list)) else ((ref,), (out,))
    assert len(refs) == len(outs)
    for o, r in zip(outs, refs):
        err = rel_err(o, r)
        assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


# --------------------------------------------------------------------------------------------- capture


class ValueGate(nn.Module):
    """A Python branch on tensor values: no tracer follows it; kept whole it runs as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.gate = ValueGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.bn(self.conv(x)))


def test_fx_trace_failure_advice_leaf_modules_works():
    """capture/fx_failure.py explain_fx_failure: 'torch.fx could not trace module ...: keep that module opaque:
    trace.leaf_modules: [<path>]': the path it names, set as given, captures the model."""
    model = randomize_batchnorms(GatedNet())
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "fx"}})
    found = re.search(r"trace\.leaf_modules: \['([^']+)'\]", str(raised.value))
    assert found, str(raised.value)
    result = fuse(model, {"trace": {"mode": "fx", "leaf_modules": [found.group(1)]}})
    assert count_batchnorms(result.graph_module) == 0
    for sign in (1, -1):
        assert_matches(model, result.graph_module, sign * torch.rand(2, 3, 5, 5))


class ShapeZeros(nn.Module):
    """torch.zeros(x.shape[0], ...): symbolic tracing cannot build it; torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x)).mean((2, 3))
        return y + torch.zeros(x.shape[0], 4)


def test_fx_trace_failure_advice_trace_mode_export_works():
    """capture/fx_failure.py explain_fx_failure: 'trace.mode: export (or auto, the default, with example inputs)'."""
    model = randomize_batchnorms(ShapeZeros())
    x = torch.randn(3, 3, 6, 6)
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "fx"}}, example_inputs=x)
    assert "trace.mode: export (or auto, the default, with example inputs)" in str(raised.value)
    for mode in ("export", "auto"):
        result = fuse(model, {"trace": {"mode": mode}}, example_inputs=x)
        assert result.report.capture_mode == "export" and count_batchnorms(result.graph_module) == 0
        assert_matches(model, result.graph_module, x)
        assert_matches(model, result.graph_module, torch.randn(5, 3, 6, 6))


def value_gate(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if x.sum() > 0 else x


class CallsFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return value_gate(self.bn(self.conv(x)))


def test_fx_trace_failure_advice_autowrap_functions_works():
    """capture/fx_failure.py explain_fx_failure: 'move the offending code into a free function and list it in
    trace.autowrap_functions (['pkg.module:function'])'."""
    model = randomize_batchnorms(CallsFunction())
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "fx"}})
    assert "trace.autowrap_functions (['pkg.module:function'])" in str(raised.value)
    result = fuse(model, {"trace": {"mode": "fx", "autowrap_functions": ["test_advice:value_gate"]}})
    assert count_batchnorms(result.graph_module) == 0
    for sign in (1, -1):
        assert_matches(model, result.graph_module, sign * torch.rand(2, 3, 5, 5))


class FlagArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if double:
            return y * 2
        return y


def test_fx_trace_failure_advice_concrete_args_works():
    """capture/fx_failure.py explain_fx_failure: 'on a flag argument, pin it with trace.concrete_args'."""
    model = randomize_batchnorms(FlagArgument())
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "fx"}})
    assert "pin it with trace.concrete_args" in str(raised.value)
    result = fuse(model, {"trace": {"mode": "fx", "concrete_args": {"double": True}}})
    assert count_batchnorms(result.graph_module) == 0
    assert_matches(model, result.graph_module, torch.randn(2, 3, 4, 4), True)


def test_auto_mode_without_example_inputs_advice_works():
    """capture/graph.py: 'trace.mode is auto but no example inputs were given, so the torch.export fallback could
    not run: pass example_inputs=(tensor, ...) to fuse()'."""
    model = randomize_batchnorms(ShapeZeros())
    with pytest.raises(TraceError) as raised:
        fuse(model)
    assert "pass example_inputs=(tensor, ...) to fuse()" in str(raised.value)
    x = torch.randn(3, 3, 6, 6)
    result = fuse(model, example_inputs=(x,))
    assert count_batchnorms(result.graph_module) == 0
    assert_matches(model, result.graph_module, x)


def test_export_mode_without_example_inputs_advice_works():
    """capture/graph.py _capture_export: 'trace.mode=export needs example inputs: pass example_inputs=(tensor, ...)
    to fuse()'."""
    model = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "export"}})
    assert "pass example_inputs=(tensor, ...) to fuse()" in str(raised.value)
    x = torch.randn(2, 3, 6, 6)
    result = fuse(model, {"trace": {"mode": "export"}}, example_inputs=(x,))
    assert count_batchnorms(result.graph_module) == 0
    assert_matches(model, result.graph_module, x)


class InputGate(nn.Module):
    """A branch on the input's values, its two ways computing differently."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return y * 2
        return y


class InputGatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.gate = InputGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x, self.bn(self.conv(x)))


def test_export_capture_failure_advice_leaf_module_and_fx_works():
    """capture/graph.py _settled: 'the model branches on tensor values at ...: the observed calls take both ways ...
    so no one graph answers both ways. Fixes: make the failing code shape-generic, or wrap it in a leaf module and
    use trace.mode: fx' (torch.export captures one way of the branch; the calls take both, computing differently)."""
    model = randomize_batchnorms(InputGatedNet())
    x = torch.rand(2, 3, 6, 6)  # x and -x take both ways
    with pytest.raises(TraceError) as raised:
        fuse(model, {"trace": {"mode": "export"}}, example_inputs=x, check_inputs=[Call((-x,))])
    assert "if x.sum() > 0" in str(raised.value) and "no one graph answers both ways" in str(raised.value)
    assert "wrap it in a leaf module and use trace.mode: fx" in str(raised.value)
    result = fuse(model, {"trace": {"mode": "fx", "leaf_modules": ["test_advice:InputGate"]}}, example_inputs=x)
    assert count_batchnorms(result.graph_module) == 0
    for sign in (1, -1):
        assert_matches(model, result.graph_module, sign * torch.rand(2, 3, 5, 5))


class TypeCheckedNorm(nn.Module):
    """``isinstance(x, torch.Tensor)``: false for torch.fx's proxy, so symbolic tracing records the other branch."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return self.bn(x)
        return self.bn(x) * 2


class TypeCheckedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)
        self.norm = TypeCheckedNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.bn(self.conv(x)))


def test_unfaithful_fx_capture_advice_trace_mode_export_works():
    """capture/faithful.py: 'the fx capture of ... is unfaithful ... Fixes: trace.mode: export (or auto, the
    default, which falls back to it)'."""
    model = randomize_batchnorms(TypeCheckedNet())
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(TraceError, match="is unfaithful") as raised:
        fuse(model, {"trace": {"mode": "fx"}}, example_inputs=x)
    assert "trace.mode: export (or auto, the default, which falls back to it)" in str(raised.value)
    for mode in ("export", "auto"):
        result = fuse(model, {"trace": {"mode": mode}}, example_inputs=x)
        assert result.report.capture_mode == "export"
        assert_matches(model, result.graph_module, x)


def _leaf_advice_applied(model: nn.Module, kept: type, first_difference: str, name: str = "norm") -> None:
    """fx capture of ``model`` is refused as unfaithful, its first difference at ``first_difference``; the advice
    names module ``name`` of class ``kept`` to keep opaque, and set as worded it makes the symbolic trace faithful."""
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(TraceError, match="is unfaithful") as raised:
        fuse(model, {"trace": {"mode": "fx"}}, example_inputs=x)
    assert f"first difference at module '{first_difference}'" in str(raised.value)
    advice = re.search(rf"keep '{name}' opaque .*: trace\.leaf_modules: (\[.*\])", str(raised.value))
    assert advice is not None, str(raised.value)
    leaf_modules = ast.literal_eval(advice.group(1))
    assert leaf_modules == [f"{kept.__module__}:{kept.__qualname__}"]
    result = fuse(model, {"trace": {"mode": "fx", "leaf_modules": leaf_modules}}, example_inputs=x)
    assert result.report.capture_mode == "fx"
    assert_matches(model, result.graph_module, x)


def test_unfaithful_fx_capture_advice_leaf_modules_works():
    """capture/faithful.py: 'the fx capture of ... is unfaithful ... keep 'norm' opaque (its outputs are the first
    that differ): trace.leaf_modules: ['test_advice:TypeCheckedNorm']': the class the error names, set as it says,
    makes the symbolic trace faithful."""
    _leaf_advice_applied(randomize_batchnorms(TypeCheckedNet()), TypeCheckedNorm, "norm")


class TypeCheckedScale(nn.Module):
    """The wrongly recorded branch feeds a module called whole: the first output that differs is the BatchNorm's."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            x = x * 2
        return self.bn(x)


class TypeCheckedScaleNet(TypeCheckedNet):
    def __init__(self) -> None:
        super().__init__()
        self.norm = TypeCheckedScale()


def test_unfaithful_fx_capture_advice_names_the_module_whose_code_was_recorded_not_the_one_called_whole():
    """The BatchNorm called whole inside the module runs its own code: its output differs because its input does, so
    the advice keeps the module around it opaque (keeping nn.BatchNorm2d opaque changes nothing), and that works."""
    _leaf_advice_applied(randomize_batchnorms(TypeCheckedScaleNet()), TypeCheckedScale, "norm.bn")


class ReusedReluBlock(nn.Module):
    """torchvision's BasicBlock pattern: one ReLU module called twice, its second call ending the block (torch names
    that scope ``block.relu@1``), with a branch symbolic tracing records wrongly."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x
        if not isinstance(out, torch.Tensor):
            out = out * 2
        return self.relu(out)


class ReusedReluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.block = nn.Conv2d(3, 4, 1), ReusedReluBlock()
        self.tail = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.block(self.stem(x))) + 1


def test_unfaithful_fx_capture_advice_is_not_misled_by_a_module_called_twice():
    """The block's last node is its ReLU's second call, which an eager hook cannot tell from the first: the advice
    named the module after it ('tail'), which did not help. Now the block is compared there and named."""
    _leaf_advice_applied(randomize_batchnorms(ReusedReluNet()), ReusedReluBlock, "block", name="block")


# ------------------------------------------------------------------------------------------ configuration


def _image_model() -> nn.Module:
    return randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))).eval()


def _refused(config: dict) -> str:
    from fx_lightning.config import load_config

    with pytest.raises(ConfigError) as raised:
        load_config(config)
    return str(raised.value)


def _export_works(tmp_path, config: dict, model: nn.Module = None, x: torch.Tensor = None):
    """fuse_and_export with ``config`` runs; the fused model (and the export's default artifact, when written)
    match the fp64 original."""
    from fx_lightning import fuse_and_export, load_fused

    model = model if model is not None else _image_model()
    x = x if x is not None else torch.randn(3, 3, 6, 6)
    outcome = fuse_and_export(model, tmp_path / "fused", example_inputs=(x,), config=config)
    assert outcome.failure is None and outcome.fused_model is not None
    assert_matches(model, outcome.fused_model, x)
    if outcome.export_dir is not None:
        assert_matches(model, load_fused(outcome.export_dir), x)
    return outcome


def test_moved_key_advice_export_dynamic_batch_works(tmp_path):
    """config/loading.py _MOVED: 'trace.dynamic_batch: moved to export.dynamic_batch'."""
    assert "moved to export.dynamic_batch" in _refused({"trace": {"dynamic_batch": False}})
    model, x = randomize_batchnorms(ShapeZeros()).eval(), torch.randn(3, 3, 6, 6)
    outcome = _export_works(tmp_path, {"trace": {"mode": "export"}, "export": {"dynamic_batch": False,
                                                                              "formats": ["pt2"]}}, model, x)
    assert outcome.manifest is not None and outcome.manifest.dynamic_batch is False


def test_module_stage_pass_in_extra_advice_configure_under_passes_works(tmp_path):
    """config/loading.py: "passes.extra[0].name: 'reparameterize' works on the module before capture, not on the
    graph; configure it under passes.reparameterize instead"."""
    assert "configure it under passes.reparameterize instead" in _refused({"passes": {"extra": ["reparameterize"]}})
    _export_works(tmp_path, {"passes": {"reparameterize": {"enabled": True}}, "export": {"formats": ["pt2"]}})


def test_unknown_key_advice_did_you_mean_works(tmp_path):
    """errors.py unknown_key: "parity.rtoll: unknown key. Did you mean 'parity.rtol'?"."""
    message = _refused({"parity": {"rtoll": 1e-4}})
    found = re.search(r"Did you mean '([a-z_.]+)'\?", message)
    assert found and found.group(1) == "parity.rtol", message
    section, key = found.group(1).split(".")
    _export_works(tmp_path, {section: {key: 1e-4}, "export": {"formats": ["pt2"]}})


def test_empty_formats_advice_export_enabled_false_works(tmp_path):
    """config/schema.py ExportConfig.check: 'export.formats: empty while export.enabled is true; allowed: ... (or
    set export.enabled: false)'."""
    message = _refused({"export": {"formats": []}})
    assert "(or set export.enabled: false)" in message and "allowed: pt2" in message
    outcome = _export_works(tmp_path, {"export": {"formats": [], "enabled": False}})
    assert outcome.export_dir is None and not (tmp_path / "fused").exists()
    _export_works(tmp_path / "one", {"export": {"formats": ["pt2"]}})  # a format from the allowed list


@pytest.mark.parametrize("fix", [{"enabled": True}, {"mlflow": {"enabled": None}}, {"mlflow": {"enabled": False}}],
                         ids=["export.enabled", "mlflow.enabled-null", "mlflow.enabled-false"])
def test_mlflow_without_export_advice_works(tmp_path, fix):
    """config/schema.py ExportConfig.check: 'export.mlflow.enabled: true while export.enabled is false: ... set
    export.enabled: true, or mlflow.enabled: null or false'. Without a Trainer nothing is logged either way: the
    export runs."""
    bad = {"enabled": False, "formats": ["graph_module"], "mlflow": {"enabled": True}}
    message = _refused({"export": bad})
    assert "set export.enabled: true, or mlflow.enabled: null or false" in message
    _export_works(tmp_path, {"export": {**bad, **fix}})


@pytest.mark.parametrize("fix", [{"register_as": "fused-model"}, {"registry_uri": None}],
                         ids=["register_as", "registry_uri-null"])
def test_registry_uri_without_register_as_advice_works(tmp_path, fix):
    """config/schema.py MlflowConfig.check: 'export.mlflow.registry_uri: ... given without register_as; nothing
    would be registered: set register_as too, or registry_uri: null'."""
    mlflow = {"registry_uri": "sqlite:///registry.db"}
    assert "set register_as too, or registry_uri: null" in _refused({"export": {"mlflow": mlflow}})
    _export_works(tmp_path, {"export": {"formats": ["pt2"], "mlflow": {**mlflow, **fix}}})


def test_alias_without_register_as_advice_works(tmp_path):
    """config/schema.py MlflowConfig.check: 'export.mlflow.alias: ... given without register_as; ... set
    register_as too'."""
    assert "set register_as too" in _refused({"export": {"mlflow": {"alias": "candidate"}}})
    _export_works(tmp_path, {"export": {"formats": ["pt2"], "mlflow": {"alias": "candidate",
                                                                        "register_as": "fused-model"}}})


def test_latency_budget_advice_sets_everything_it_needs(tmp_path):
    """config/schema.py ExportConfig.check: 'export.latency_budget_ms: ... with select_strategy: min_latency; ...
    set select_strategy: max_throughput and select: fastest, or latency_budget_ms: null'. It said only
    select_strategy: max_throughput, which was then refused for want of select: fastest."""
    from fx_lightning.config import load_config

    message = _refused({"export": {"latency_budget_ms": 50.0}})
    assert "set select_strategy: max_throughput and select: fastest, or latency_budget_ms: null" in message
    cfg = load_config({"export": {"latency_budget_ms": 50.0, "select_strategy": "max_throughput",
                                  "select": "fastest"}})
    assert cfg.export.select_strategy.value == "max_throughput" and cfg.export.latency_budget_ms == 50.0
    # Where select: fastest is already set, the advice does not repeat it.
    message = _refused({"export": {"latency_budget_ms": 50.0, "select": "fastest"}})
    assert "set select_strategy: max_throughput, or latency_budget_ms: null" in message
    # The other half: no budget (the timed export itself is covered by test_sweep.py).
    _export_works(tmp_path, {"export": {"formats": ["pt2"], "latency_budget_ms": None}})


def test_strategy_without_select_fastest_advice_works():
    """config/schema.py ExportConfig.check: 'export.select_strategy: max_throughput with select: preference; ...
    set select: fastest'."""
    from fx_lightning.config import load_config

    assert "set select: fastest" in _refused({"export": {"select_strategy": "max_throughput"}})
    cfg = load_config({"export": {"select_strategy": "max_throughput", "select": "fastest"}})
    assert cfg.export.select.value == "fastest"


@pytest.mark.parametrize("target", [None, ""], ids=["null", "empty"])
def test_target_not_dotted_advice_works(tmp_path, target):
    """config/schema.py FuseConfig.check: "target: 'features-0' is not a dotted attribute path ...; use null for the
    default (backbone if present, else the whole module), or '' for the whole module"."""
    message = _refused({"target": "features-0"})
    assert "use null for the default" in message and "or '' for the whole module" in message
    _export_works(tmp_path, {"target": target, "export": {"formats": ["pt2"]}})


def test_missing_extra_pass_name_advice_works(tmp_path):
    """errors.py load_record / config/loading.py: "passes.extra[0].name: missing ...; give a value (a registered pass
    name or 'pkg.module:function')"."""
    message = _refused({"passes": {"extra": [{"options": {}}]}})
    assert "a registered pass name or 'pkg.module:function'" in message
    _export_works(tmp_path, {"passes": {"extra": [{"name": "eliminate_dead_code", "options": {}}]},
                             "export": {"formats": ["pt2"]}})


def noop_pass(gm, options, ctx):
    """A user pass that changes nothing (given by import path)."""
    return None


def test_unknown_pass_advice_works(tmp_path):
    """passes/base.py get_pass: "unknown pass 'no_such_pass'; registered passes: ... (or give an import path
    'pkg.module:function')". Every name it lists is taken in passes.extra (the module passes, which passes.extra
    refuses, were listed too) and so is an import path."""
    from fx_lightning.config import load_config

    message = _refused({"passes": {"extra": ["no_such_pass"]}})
    assert "(or give an import path 'pkg.module:function')" in message
    listed = re.search(r"registered passes: ([a-z_, ]+) \(", message).group(1).split(", ")
    assert "fuse_conv_bn" in listed and "reparameterize" not in listed and "batchnorm_forms" not in listed
    for name in listed:
        load_config({"passes": {"extra": [name]}})
    _export_works(tmp_path, {"passes": {"extra": ["test_advice:noop_pass"]}, "export": {"formats": ["pt2"]}})


# ------------------------------------------------------------------------------------ the callback (Lightning)


def _fit(tmp_path, name: str, model=None, callbacks=(), **options):
    """Fit a tiny LitClassifier (or ``model``) with FXFuseCallback(**options) after ``callbacks``; returns (model,
    callback, trainer)."""
    import lightning_helpers as H
    from fx_lightning import FXFuseCallback

    model = model if model is not None else H.LitClassifier()
    cb = FXFuseCallback(**options)
    trainer = H.make_trainer(tmp_path / name, [*callbacks, cb], **({"enable_checkpointing": False}
                                                                   if not callbacks else {}))
    trainer.fit(model, *H.loaders())
    return model, cb, trainer


def _refused_fit(tmp_path, error=Exception, **kwargs) -> str:
    with pytest.raises(error) as raised:
        _fit(tmp_path, "refused", **kwargs)
    return str(raised.value)


def _fused_backbone_works(model, cb) -> None:
    """The callback fused the backbone, and it matches the trained backbone (fp64 eval copy)."""
    assert cb.result is not None and cb.error is None
    assert_matches(model.backbone, cb.result.graph_module, torch.randn(5, 3, 8, 8))


@pytest.mark.parametrize("fix", ["weights-last", "add-ModelCheckpoint"])
def test_weights_best_without_checkpoint_callback_advice_works(tmp_path, fix):
    """callback/preflight.py _check_weights (stage 'weights'): "weights: 'best' needs a ModelCheckpoint callback in
    the Trainer, and there is none. Fix: add a ModelCheckpoint that saves (monitor=..., save_top_k >= 1) or use
    weights: last"."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    message = _refused_fit(tmp_path, ConfigError, weights="best", export={"enabled": False})
    assert "Fix: add a ModelCheckpoint that saves (monitor=..., save_top_k >= 1) or use weights: last" in message
    if fix == "weights-last":
        model, cb, _ = _fit(tmp_path, "fixed", weights="last", export={"enabled": False})
    else:
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="val_loss", save_top_k=1)
        model, cb, _ = _fit(tmp_path, "fixed", callbacks=[ckpt], weights="best", export={"enabled": False})
        assert ckpt.best_model_path
        import lightning_helpers as H

        model = H.LitClassifier()  # the best checkpoint's weights are what was fused
        model.load_state_dict(torch.load(ckpt.best_model_path, weights_only=False)["state_dict"])
    _fused_backbone_works(model, cb)


@pytest.mark.parametrize("fix", ["save_top_k", "weights-last"])
def test_weights_best_with_save_top_k_zero_advice_works(tmp_path, fix):
    """callback/preflight.py _check_weights (stage 'weights'): "weights: 'best', but the ModelCheckpoint has
    save_top_k=0". The stage's advice, "add a ModelCheckpoint", could not work (the Trainer's first ModelCheckpoint
    is the one read): it now says to give that one save_top_k >= 1."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def ckpt(top_k: int, monitor: str = "val_loss") -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / f"ckpts{top_k}", monitor=monitor, save_top_k=top_k)

    message = _refused_fit(tmp_path, ConfigError, callbacks=[ckpt(0)], weights="best", export={"enabled": False})
    assert "Fix: give that ModelCheckpoint save_top_k >= 1 (or -1), or use weights: last" in message
    assert "add a ModelCheckpoint" not in message
    # The stage's old advice, followed: a second ModelCheckpoint that saves; still refused.
    assert "save_top_k=0" in _refused_fit(tmp_path, ConfigError, callbacks=[ckpt(0), ckpt(1, "score")], weights="best",
                                          export={"enabled": False})
    if fix == "save_top_k":
        model, cb, trainer = _fit(tmp_path, "fixed", callbacks=[ckpt(1)], weights="best", export={"enabled": False})
        import lightning_helpers as H

        model = H.LitClassifier()
        model.load_state_dict(torch.load(trainer.checkpoint_callback.best_model_path,
                                         weights_only=False)["state_dict"])
    else:
        model, cb, _ = _fit(tmp_path, "fixed", callbacks=[ckpt(0)], weights="last", export={"enabled": False})
    _fused_backbone_works(model, cb)


@pytest.mark.parametrize("fix", ["cpu", "auto"])
def test_unavailable_device_advice_works(tmp_path, fix):
    """pipeline/targets.py resolve_device (stage 'device'): "device: 'cuda:3' is not available in this process ...;
    use auto (where training ran) or cpu"."""
    if torch.cuda.device_count() > 3:
        pytest.skip("cuda:3 exists here")
    message = _refused_fit(tmp_path, ConfigError, device="cuda:3", export={"enabled": False})
    assert "use auto (where training ran) or cpu" in message
    model, cb, _ = _fit(tmp_path, "fixed", device=fix, export={"enabled": False})
    _fused_backbone_works(model, cb)


def test_export_dir_in_checkpoint_directory_advice_works(tmp_path):
    """pipeline/targets.py refuse_protected (stage 'export directory'): "export.dir: ... could replace a checkpoint.
    Choose another export.dir"."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from fx_lightning import ExportError, load_fused

    ckpts = tmp_path / "ckpts"
    message = _refused_fit(tmp_path, ExportError, callbacks=[ModelCheckpoint(dirpath=ckpts)],
                           export={"dir": str(ckpts), "formats": ["pt2"]})
    assert "Choose another export.dir" in message
    model, cb, _ = _fit(tmp_path, "fixed", callbacks=[ModelCheckpoint(dirpath=ckpts)],
                        export={"dir": str(tmp_path / "fused"), "formats": ["pt2"]})
    _fused_backbone_works(model, cb)
    assert_matches(model.backbone, load_fused(tmp_path / "fused"), torch.randn(5, 3, 8, 8))


@pytest.mark.parametrize("fix", [None, False])
def test_mlflow_required_without_logger_advice_works(tmp_path, fix):
    """callback/mlflow_logging.py (stage 'export.mlflow'): "export.mlflow.enabled: true, but the Trainer has no
    MLFlowLogger; add one (...), or set export.mlflow.enabled: null (log when one is attached) or false"."""
    message = _refused_fit(tmp_path, ConfigError, export={"formats": ["graph_module"], "mlflow": {"enabled": True}})
    assert "or set export.mlflow.enabled: null (log when one is attached) or false" in message
    model, cb, _ = _fit(tmp_path, "fixed", export={"formats": ["graph_module"], "mlflow": {"enabled": fix}})
    _fused_backbone_works(model, cb)
    assert cb.export_dir is not None and cb.mlflow is None


def _two_submodules_lit():
    """A LightningModule whose steps call ``encoder`` and ``head`` directly, never its own forward: both hold trained
    parameters, so which one is the model cannot be observed."""
    import lightning_helpers as H
    import torch.nn.functional as F

    class Lit(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = H.TinyBackbone(8)
            self.head = nn.Linear(8, H.NUM_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.head(self.encoder(x)), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.head(self.encoder(x)), y))

    return Lit()


def test_target_null_with_steps_calling_submodules_advice_works(tmp_path):
    """callback/observe.py _trained_one: "target: null, and the LightningModule's steps never call its forward: they
    call the submodules ... directly, and more than one holds trained parameters. Fix: set target to the one to fuse
    (e.g. target: encoder)"."""
    message = _refused_fit(tmp_path, ConfigError, model=_two_submodules_lit(), export={"enabled": False})
    found = re.search(r"Fix: set target to the one to fuse \(e\.g\. target: ([\w.]+)\)", message)
    assert found, message
    model, cb, _ = _fit(tmp_path, "fixed", model=_two_submodules_lit(), target=found.group(1),
                        export={"enabled": False})
    assert found.group(1) == "encoder" and cb.result is not None
    assert_matches(model.encoder, cb.result.graph_module, torch.randn(5, 3, 8, 8))


def _scored_through_a_method_lit(own_forward: bool, library_base: bool = False):
    """pykeen's LCWALitModule and normflows' README: the steps reach the model through another method than its
    forward (``self.model.score(x)``), and the only module they call is a loss holding no parameters (pykeen), or
    none at all (normflows, a functional loss); the LightningModule's forward, where it has one, scores too."""
    import lightning_helpers as H

    class Scorer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.head = H.TinyBackbone(8), nn.Linear(8, H.NUM_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.score(x)

        def score(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x))

    class Lit(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.model = Scorer()
            self.loss = nn.CrossEntropyLoss()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss(self.model.score(x), y) if own_forward else F.cross_entropy(self.model.score(x), y)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.training_step(batch, batch_idx))

    if own_forward:
        Lit.forward = lambda self, x: self.model.score(x)  # type: ignore[assignment, method-assign]
    elif library_base:
        Lit.forward = _LibraryBase.forward  # type: ignore[method-assign]  # a base class's that only raises
    else:
        import lightning.pytorch as pl

        Lit.forward = pl.LightningModule.forward  # type: ignore[method-assign]  # none of its own: Lightning's raises
    return Lit()


@pytest.mark.parametrize("without", ["no-loader", "limit-val-batches-0"])
def test_steps_reaching_the_model_through_another_method_with_no_validation_ahead_are_refused_before_training(
        tmp_path, without):
    """No validation loader, or ``limit_val_batches=0``: no validation step will run to call a submodule holding
    weights, so what the training steps called is all there is, and the end of fit would refuse; the preflight
    said "not proven" and let the whole training run first. Now refused before the first optimizer step, with the
    advice the test above shows working."""
    import lightning_helpers as H
    from fx_lightning import FXFuseCallback

    train, val = H.loaders()
    options = {"limit_val_batches": 0} if without == "limit-val-batches-0" else {}
    trainer = H.make_trainer(tmp_path, [FXFuseCallback(export={"enabled": False})], **options)
    with pytest.raises(ConfigError) as raised:
        trainer.fit(_scored_through_a_method_lit(False), train, *([val] if options else []))
    message = str(raised.value)
    assert "before the first optimizer step; nothing was trained" in message and trainer.global_step == 0, message
    assert "target: model, parity.input: 0" in message, message


class _LibraryBase:
    def forward(self, *args, **kwargs):
        """Subclasses implement forward (a library's base LightningModule)."""
        raise NotImplementedError("forward is implemented by subclasses")


def test_steps_reaching_the_model_through_another_method_fuse_the_modules_own_forward(tmp_path):
    """pykeen: the steps call a loss holding no weights and reach the model through ``score``: the loss was fused
    and said to hold the trained parameters. Now the LightningModule's own forward is fused, on the batches' input
    as when nothing is observed, and matches the trained module."""
    model, cb, _ = _fit(tmp_path, "fused", model=_scored_through_a_method_lit(True), export={"enabled": False})
    assert cb.result is not None and cb.error is None
    assert not any(n.kind.name == "target_called_by_steps" for n in cb.outcome.notes)
    assert_matches(model, cb.result.graph_module, torch.randn(5, 3, 8, 8))


@pytest.mark.parametrize("library_base", [False, True], ids=["lightning-forward", "base-class-raises"])
def test_steps_reaching_the_model_through_another_method_without_a_forward_are_refused_with_advice_that_works(
        tmp_path, library_base):
    """normflows: no forward, the steps call ``self.model.forward_kld(x)``: the missing forward failed after
    training. Now refused before training (validation seen in Lightning's sanity check), naming where the weights
    are, and the setting the error gives works (parity.input feeds the target where there is no forward). A library
    base class whose forward only raises NotImplementedError has none either (it was taken for one)."""
    import lightning_helpers as H
    from fx_lightning import FXFuseCallback

    trainer = H.make_trainer(tmp_path / "refused", [FXFuseCallback(export={"enabled": False})], num_sanity_val_steps=2)
    with pytest.raises(ConfigError) as raised:
        trainer.fit(_scored_through_a_method_lit(False, library_base), *H.loaders())
    message = str(raised.value)
    assert "before the first optimizer step; nothing was trained" in message, message
    assert "the LightningModule has no forward; they call no submodule: its weights are in model (" in message
    found = re.search(r"target: ([\w.]+), parity\.input: (\S+?)\.?$", message, re.MULTILINE)
    assert found and found.groups() == ("model", "0"), message
    model, cb, _ = _fit(tmp_path, "fixed", model=_scored_through_a_method_lit(False, library_base),
                        target=found.group(1), parity={"input": int(found.group(2))}, export={"enabled": False})
    assert cb.result is not None and cb.error is None
    assert_matches(model.model, cb.result.graph_module, torch.randn(5, 3, 8, 8))


def test_steps_reaching_the_model_through_another_method_before_validation_is_seen_are_left_to_the_end_of_fit(
        tmp_path):
    """Without Lightning's sanity check the preflight runs before any validation step, which may still call a
    submodule holding weights: it says that (it spoke of state training fills, from the missing forward's error),
    and the end of fit refuses with the same advice (validation then seen, calling no such submodule): an error
    after training dropped its own advice."""
    import warnings

    import lightning_helpers as H
    from fx_lightning import FXFuseCallback

    trainer = H.make_trainer(tmp_path, [FXFuseCallback(export={"enabled": False})], num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ConfigError) as raised:
        warnings.simplefilter("always")
        trainer.fit(_scored_through_a_method_lit(False), *H.loaders())
    lines = [str(w.message) for w in caught if "preflight (" in str(w.message)]
    assert lines and "not proven: the LightningModule has no forward and its training steps called no submodule " \
        "holding weights" in lines[0] and "memory bank" not in lines[0], lines
    assert "target: model, parity.input: 0" in str(raised.value) and trainer.global_step > 0


def test_backbone_only_note_advice_target_whole_works(tmp_path):
    """callback/observe.py BACKBONE_ONLY (a note, not a refusal): "target: null fused backbone ..., but its forward
    also runs head ... around it, which the artifact leaves out: set target: '' to export the whole forward"."""
    from fx_lightning import load_fused
    from fx_lightning.callback.observe import BACKBONE_ONLY

    model, cb, _ = _fit(tmp_path, "default", export={"enabled": False})
    assert any(n.kind == BACKBONE_ONLY for n in cb.outcome.notes)
    assert "set target: '' to export the whole forward" in BACKBONE_ONLY.template
    model, cb, _ = _fit(tmp_path, "whole", target="", export={"formats": ["graph_module"]})
    assert not any(n.kind == BACKBONE_ONLY for n in cb.outcome.notes)
    x = torch.randn(5, 3, 8, 8)
    assert_matches(model, load_fused(cb.export_dir), x)  # backbone and head: the LightningModule's forward


class Noisy(nn.Module):
    """Random in eval mode: no fused model can match it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        return y + torch.randn_like(y)


def test_parity_failure_advice_on_failure_warn_works(tmp_path):
    """pipeline/driver.py _parity_failure: "parity FAILED ...: Nothing was exported. (set parity.on_failure: warn to
    only warn)": with it set, the same run warns and returns (nothing exported, as the message says)."""
    from fx_lightning import ParityError, fuse_and_export

    x = torch.randn(3, 3, 6, 6)
    with pytest.raises(ParityError) as raised:
        fuse_and_export(Noisy(), tmp_path / "a", example_inputs=(x,), config={"export": {"formats": ["pt2"]}})
    assert "(set parity.on_failure: warn to only warn)" in str(raised.value)
    with pytest.warns(UserWarning, match="parity FAILED"):
        outcome = fuse_and_export(Noisy(), tmp_path / "b", example_inputs=(x,),
                                  config={"export": {"formats": ["pt2"]}, "parity": {"on_failure": "warn"}})
    assert outcome.failure is None and outcome.parity is not None and not outcome.parity.passed
    assert outcome.export_dir is None and not (tmp_path / "b").exists()


# ------------------------------------------------------------------------------------ fuse_and_export's inputs


def test_no_inputs_advice_works(tmp_path):
    """errors.py require_inputs (fuse_and_export): "fuse_and_export(): no inputs for checking and exporting the fused
    model: give batches (data to verify on) or example_inputs (forward's arguments)"."""
    from fx_lightning import fuse_and_export

    model, x = _image_model(), torch.randn(3, 3, 6, 6)
    with pytest.raises(ConfigError) as raised:
        fuse_and_export(model, tmp_path / "none", config={"export": {"formats": ["pt2"]}})
    assert "give batches (data to verify on) or example_inputs (forward's arguments)" in str(raised.value)
    _export_works(tmp_path / "example", {"export": {"formats": ["pt2"]}}, model, x)
    outcome = fuse_and_export(model, tmp_path / "batches", batches=[(x, torch.zeros(3))],
                              config={"export": {"formats": ["pt2"]}})
    assert outcome.parity is not None and outcome.parity.passed
    assert_matches(model, outcome.fused_model, x)


def test_parity_input_not_found_advice_key_works(tmp_path):
    """pipeline/inputs.py / common/batches.py: "parity.input: forward's input could not be taken out of the batch
    ... parity.input can be a key of a dict batch ('image'), ...": the key set, the run works."""
    from fx_lightning import fuse_and_export

    model, x = _image_model(), torch.randn(3, 3, 6, 6)
    batches = [{"pixels": x, "label": torch.zeros(3)}]
    with pytest.raises(ConfigError) as raised:
        fuse_and_export(model, tmp_path / "a", batches=batches, config={"export": {"formats": ["pt2"]}})
    assert "parity.input can be a key of a dict batch ('image')" in str(raised.value)
    assert str(raised.value).count("parity.input can be a key of a dict batch") == 1  # said once
    # A key that is not there: the message lists the batch's keys.
    with pytest.raises(ConfigError) as raised:
        fuse_and_export(model, tmp_path / "b", batches=batches, config={"parity": {"input": "image"}})
    keys = re.search(r"its keys: ([\w, ]+)\.", str(raised.value)).group(1).split(", ")
    assert keys == ["pixels", "label"]
    outcome = fuse_and_export(model, tmp_path / "c", batches=batches,
                              config={"parity": {"input": keys[0]}, "export": {"formats": ["pt2"]}})
    assert outcome.parity is not None and outcome.parity.passed and outcome.parity.batches == 1
    from fx_lightning import load_fused

    assert_matches(model, load_fused(outcome.export_dir), x)


def test_parity_input_function_advice_works(tmp_path):
    """common/batches.py PARITY_INPUT_SPELLINGS: "... or 'pkg.module:function' taking the batch and returning
    forward's argument"."""
    from fx_lightning import fuse_and_export, load_fused

    model, x = _image_model(), torch.randn(3, 3, 6, 6)
    batches = [{"sample": {"pixels": x}, "label": torch.zeros(3)}]
    with pytest.raises(ConfigError) as raised:
        fuse_and_export(model, tmp_path / "a", batches=batches, config={"export": {"formats": ["pt2"]}})
    assert "'pkg.module:function' taking the batch and returning forward's argument" in str(raised.value)
    outcome = fuse_and_export(model, tmp_path / "b", batches=batches,
                              config={"parity": {"input": "test_advice:pixels_of"}, "export": {"formats": ["pt2"]}})
    assert outcome.parity is not None and outcome.parity.passed
    assert_matches(model, load_fused(outcome.export_dir), x)


def pixels_of(batch):
    """parity.input for the nested batches above."""
    return batch["sample"]["pixels"]


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.spare = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)


def test_target_never_called_advice_works(tmp_path):
    """pipeline/inputs.py: "target: the target module is never called by the model's forward, so it cannot be fused
    in place; point `target` at a module that forward uses"."""
    model, x = randomize_batchnorms(Unused()).eval(), torch.randn(3, 3, 6, 6)
    with pytest.raises(ConfigError) as raised:
        _export_works(tmp_path / "a", {"target": "spare", "export": {"formats": ["pt2"]}}, model, x)
    assert "point `target` at a module that forward uses" in str(raised.value)
    from fx_lightning import fuse_and_export, load_fused

    outcome = fuse_and_export(model, tmp_path / "b", example_inputs=(x,),
                              config={"target": "backbone", "export": {"formats": ["pt2"]}})
    assert outcome.target == "backbone" and outcome.parity is not None and outcome.parity.passed
    assert_matches(model.backbone, load_fused(outcome.export_dir), x)


# ------------------------------------------------------------------------------------------- export settings


def test_export_dir_not_a_directory_advice_works(tmp_path):
    """export/write/writer.py: "<dir>: exists and is not a directory; choose another export.dir"."""
    from fx_lightning import ExportError, fuse_and_export

    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ExportError) as raised:
        fuse_and_export(_image_model(), tmp_path / "file", example_inputs=(torch.randn(3, 3, 6, 6),),
                        config={"export": {"formats": ["pt2"]}})
    assert "choose another export.dir" in str(raised.value)
    _export_works(tmp_path / "other", {"export": {"formats": ["pt2"]}})


@pytest.mark.parametrize("fix", ["remove", "overwrite"])
def test_export_dir_exists_without_overwrite_advice_works(tmp_path, fix):
    """export/write/writer.py: "<dir>: already exists and export.overwrite is false; remove it or set it true"."""
    import shutil

    from fx_lightning import ExportError

    config = {"export": {"formats": ["pt2"], "overwrite": False}}
    _export_works(tmp_path, config)
    with pytest.raises(ExportError) as raised:
        _export_works(tmp_path, config)
    assert "remove it or set it true" in str(raised.value)
    if fix == "remove":
        shutil.rmtree(tmp_path / "fused")
        _export_works(tmp_path, config, model=_image_model())
    else:
        torch.manual_seed(1)  # another model: the export is replaced
        _export_works(tmp_path, {"export": {"formats": ["pt2"], "overwrite": True}},
                      model=randomize_batchnorms(_image_model(), seed=1))


@pytest.mark.parametrize("fix", ["one-per-column", "null"])
def test_labels_of_the_wrong_length_advice_works(tmp_path, fix):
    """export/write/input_contract.py: "export.labels: 2 class names ['a', 'b'] but the exported model's first output
    has 3 columns; give one name per column, or null"."""
    from fx_lightning.export import read_manifest

    with pytest.raises(ConfigError) as raised:
        _export_works(tmp_path, {"export": {"formats": ["pt2"], "labels": ["a", "b"]}})
    assert "give one name per column, or null" in str(raised.value)
    labels = ["a", "b", "c"] if fix == "one-per-column" else None
    outcome = _export_works(tmp_path, {"export": {"formats": ["pt2"], "labels": labels}})
    assert read_manifest(outcome.export_dir).labels == (labels or [])


MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _preprocess_works(tmp_path, preprocess: dict) -> None:
    """An export with ``export.preprocess`` set runs; its artifact takes raw uint8 pixels and matches the fp64
    original on them normalised (this test's own normalisation)."""
    from fx_lightning import fuse_and_export, load_fused

    model = _image_model()
    mean = torch.tensor(preprocess["mean"], dtype=torch.float64)[None, :, None, None]
    std = torch.tensor(preprocess["std"], dtype=torch.float64)[None, :, None, None]
    raw = torch.randint(0, 256, (3, 3, 6, 6), dtype=torch.uint8)
    normalised = (raw.double() / 255 - mean) / std
    outcome = fuse_and_export(model, tmp_path / "fused", example_inputs=(normalised.float(),),
                              config={"export": {"formats": ["pt2"], "preprocess": {"enabled": True, **preprocess}}})
    with torch.no_grad():
        want = copy_fp64(model)(normalised)
    assert rel_err(load_fused(outcome.export_dir)(raw), want) <= TOL


def copy_fp64(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).double().eval()


@pytest.mark.parametrize("fix", ["mean-and-std", "disabled"])
def test_preprocess_without_mean_and_std_advice_works(tmp_path, fix):
    """export/write/input_contract.py: "export.preprocess.enabled: true with mean: null and std: null, and there is
    no datamodule here to find them in; set export.preprocess.mean and export.preprocess.std (one value per channel),
    or export.preprocess.enabled: false"."""
    with pytest.raises(ConfigError) as raised:
        _export_works(tmp_path / "a", {"export": {"formats": ["pt2"], "preprocess": {"enabled": True}}})
    assert "set export.preprocess.mean and export.preprocess.std (one value per channel), or " \
           "export.preprocess.enabled: false" in str(raised.value)
    if fix == "mean-and-std":
        _preprocess_works(tmp_path / "b", {"mean": MEAN, "std": STD})
    else:
        _export_works(tmp_path / "b", {"export": {"formats": ["pt2"], "preprocess": {"enabled": False}}})


def test_preprocess_channel_count_advice_works(tmp_path):
    """export/write/prologue.py: "export.preprocess.mean: 1 value(s) [0.5] but the model's input (3, 3, 6, 6) has 3
    channels on axis 1; give one mean and std per channel"."""
    with pytest.raises(ConfigError) as raised:
        _export_works(tmp_path / "a", {"export": {"formats": ["pt2"], "preprocess": {
            "enabled": True, "mean": [0.5], "std": [0.2]}}})
    assert "give one mean and std per channel" in str(raised.value)
    _preprocess_works(tmp_path / "b", {"mean": [0.5] * 3, "std": [0.2] * 3})


# ------------------------------------------------------------------------------------ load_fused's call checks


class OptionalBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor = None) -> torch.Tensor:
        y = self.bn(self.conv(x)).mean((2, 3))
        return y if bias is None else y + bias


@pytest.mark.parametrize("fix", ["leave-it-out", "pass-it-in-the-calls"])
def test_argument_never_observed_advice_works(tmp_path, fix):
    """export/load/interface.py _NEVER_OBSERVED: "takes 1 input(s) (x); got 2: no call the export was built from ...
    passed an argument from position 2 on ... Leave it out, or pass it in the calls the training and validation steps
    make, and the export takes it" (here the calls are fuse_and_export's example inputs)."""
    from fx_lightning import ExportError, fuse_and_export, load_fused

    model = randomize_batchnorms(OptionalBias()).eval()
    x, bias = torch.randn(3, 3, 6, 6), torch.randn(3, 4)
    outcome = fuse_and_export(model, tmp_path / "a", example_inputs=(x,), config={"export": {"formats": ["pt2"]}})
    with pytest.raises(ExportError) as raised:
        load_fused(outcome.export_dir)(x, bias)
    assert "Leave it out, or pass it in the calls" in str(raised.value)
    if fix == "leave-it-out":
        assert_matches(model, load_fused(outcome.export_dir), x)
    else:
        outcome = fuse_and_export(model, tmp_path / "b", example_inputs=(x, bias),
                                  config={"export": {"formats": ["pt2"]}})
        assert_matches(model, load_fused(outcome.export_dir), x, bias)


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, views):
        return torch.stack([self.bn(self.conv(v)).mean((1, 2, 3)) for v in views], 1)


def test_input_not_built_for_advice_export_from_calls_that_pass_it_works(tmp_path):
    """export/load/interface.py _refuse_unknown: "... given, which the artifact was not built for (it takes ...):
    ...; leave it out only if that is the call you want, else export from calls that pass it"."""
    from fx_lightning import ExportError, fuse_and_export, load_fused

    model = randomize_batchnorms(Views()).eval()
    two = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    five = two + [torch.randn(4, 3, 8, 8) for _ in range(3)]
    outcome = fuse_and_export(model, tmp_path / "two", example_inputs=(two,), config={"export": {"formats": ["pt2"]}})
    with pytest.raises(ExportError) as raised:
        load_fused(outcome.export_dir)(five)
    assert "else export from calls that pass it" in str(raised.value)
    outcome = fuse_and_export(model, tmp_path / "five", example_inputs=(five,),
                              config={"export": {"formats": ["pt2"]}})
    assert_matches(model, load_fused(outcome.export_dir), five)


# ----------------------------------------------------------------------- the preflight's advice for each stage


def test_missing_target_stage_advice_works(tmp_path):
    """callback/preflight.py FIXES[target] after pipeline/targets.py: "target: 'encoder': 'encoder' is not a
    submodule of <root> ... Children of <root>: backbone (TinyBackbone), head (Linear). Fix: point target at a
    submodule that the LightningModule's forward calls"."""
    message = _refused_fit(tmp_path, ConfigError, target="encoder", export={"enabled": False})
    assert "Fix: point target at a submodule that the LightningModule's forward calls" in message
    assert "backbone (TinyBackbone)" in message
    model, cb, _ = _fit(tmp_path, "fixed", target="backbone", export={"enabled": False})
    _fused_backbone_works(model, cb)


class GatedBackbone(nn.Module):
    """TinyBackbone-like, with a value branch in a submodule: the callback's capture refuses it before training."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.gate = ValueGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.bn(self.conv(x))).mean((2, 3))


def test_capture_stage_advice_leaf_modules_works_in_the_callback(tmp_path):
    """callback/preflight.py FIXES[capture] ("see the fixes listed above (trace.mode, trace.leaf_modules,
    trace.autowrap_functions)") after capture/graph.py's 'torch.fx could not trace module ... keep that module
    opaque: trace.leaf_modules: [<path>]' (trace.mode: fx; auto keeps the module whole by itself): the path it names,
    set, and the fit fuses."""
    import lightning_helpers as H

    message = _refused_fit(tmp_path, TraceError, model=H.LitClassifier(backbone=GatedBackbone()),
                           trace={"mode": "fx"}, export={"enabled": False})
    assert "Fix: see the fixes listed above (trace.mode, trace.leaf_modules, trace.autowrap_functions)" in message
    path = re.search(r"trace\.leaf_modules: \['([^']+)'\]", message).group(1)
    model, cb, _ = _fit(tmp_path, "fixed", model=H.LitClassifier(backbone=GatedBackbone()),
                        trace={"mode": "fx", "leaf_modules": [path]}, export={"enabled": False})
    assert H.count_batchnorms(cb.result.graph_module) == 0
    for sign in (1, -1):
        assert_matches(model.backbone, cb.result.graph_module, sign * torch.rand(5, 3, 8, 8))


def test_passes_stage_advice_disable_it_works(tmp_path):
    """callback/preflight.py FIXES[passes]: "pass 'sample_passes:raises' raised ValueError: ... Fix: fix the pass named
    above, or disable it under passes" (a user pass: passes.extra[i].enabled: false)."""
    from fx_lightning import PassError

    message = _refused_fit(tmp_path, PassError, passes={"extra": ["sample_passes:raises"]}, export={"enabled": False})
    assert "Fix: fix the pass named above, or disable it under passes" in message
    model, cb, _ = _fit(tmp_path, "fixed", passes={"extra": [{"name": "sample_passes:raises", "enabled": False}]},
                        export={"enabled": False})
    _fused_backbone_works(model, cb)


@pytest.mark.parametrize("labels", [["a", "b", "c", "d"], None], ids=["one-per-column", "null"])
def test_labels_in_the_callback_get_their_own_advice(tmp_path, labels):
    """export/write/input_contract.py at the preflight's stage 'export': "export.labels: 2 class names ... but the
    exported model's first output has 4 columns". The stage's advice, "drop the failing format from export.formats",
    cannot help; the error now carries its own: one name per column, or null."""
    from fx_lightning import load_fused
    from fx_lightning.export import read_manifest

    message = _refused_fit(tmp_path, ConfigError, target="", export={"formats": ["graph_module"],
                                                                     "labels": ["a", "b"]})
    assert "Fix: give export.labels one name per column of the first output, or set it to null" in message
    assert "drop the failing format" not in message
    model, cb, _ = _fit(tmp_path, "fixed", target="", export={"formats": ["graph_module"], "labels": labels})
    assert read_manifest(cb.export_dir).labels == (labels or [])
    assert_matches(model, load_fused(cb.export_dir), torch.randn(5, 3, 8, 8))


def test_preprocess_channels_in_the_callback_get_their_own_advice(tmp_path):
    """export/write/prologue.py at the preflight's stage 'parity': "export.preprocess.mean: 1 value(s) [0.5] but the
    model's input ... has 3 channels". The stage's advice, "check parity.input and the model's outputs", does not
    name what to change; the error now carries its own: one mean and std per channel."""
    from fx_lightning import load_fused

    bad = {"formats": ["graph_module"], "preprocess": {"enabled": True, "mean": [0.5], "std": [0.2]}}
    message = _refused_fit(tmp_path, ConfigError, export=bad)
    assert "Fix: give export.preprocess.mean and std one value per channel of the input" in message
    assert "check parity.input" not in message
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    model, cb, _ = _fit(tmp_path, "fixed", export={**bad, "preprocess": {"enabled": True, "mean": mean, "std": std}})
    raw = torch.randint(0, 256, (5, 3, 8, 8), dtype=torch.uint8)
    normalised = (raw.double() / 255 - torch.tensor(mean, dtype=torch.float64)[None, :, None, None]) / \
        torch.tensor(std, dtype=torch.float64)[None, :, None, None]
    with torch.no_grad():
        want = copy_fp64(model.backbone)(normalised)
    assert rel_err(load_fused(cb.export_dir)(raw), want) <= TOL


def test_preprocess_on_a_model_without_one_image_input_advice_works(tmp_path):
    """export/write/prologue.py check_prologue_input: "export.preprocess: the prologue needs one 4-D NCHW image
    tensor ...; the model's input is .... Set export.preprocess.enabled: false for this model"."""
    model = randomize_batchnorms(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))).eval()
    x = torch.randn(5, 3)
    with pytest.raises(ConfigError) as raised:
        _export_works(tmp_path / "a", {"export": {"formats": ["pt2"], "preprocess": {
            "enabled": True, "mean": MEAN, "std": STD}}}, model, x)
    assert "Set export.preprocess.enabled: false for this model" in str(raised.value)
    assert raised.value.fix == "set export.preprocess.enabled: false for this model"
    _export_works(tmp_path / "b", {"export": {"formats": ["pt2"], "preprocess": {
        "enabled": False, "mean": MEAN, "std": STD}}}, model, x)


# -------------------------------------------------------------------------------------------------- more


def test_zero_samples_advice_works(tmp_path):
    """capture/graph.py _at_least_two: "a tensor argument has batch size 0; give at least one sample". (Through
    fuse_and_export an empty example stops earlier, as a ModelError; the writer's copy of this message is not
    reached there.)"""
    from fx_lightning import FXLightningError

    model = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    with pytest.raises(FXLightningError) as raised:
        fuse(model, {"trace": {"mode": "export"}}, example_inputs=torch.randn(0, 3, 6, 6))
    assert "give at least one sample" in str(raised.value)
    x = torch.randn(1, 3, 6, 6)
    result = fuse(model, {"trace": {"mode": "export"}}, example_inputs=x)
    assert_matches(model, result.graph_module, x)
    assert_matches(model, result.graph_module, torch.randn(3, 3, 6, 6))  # one sample: still any batch size


def test_preprocess_mean_without_std_advice_works(tmp_path):
    """config/schema.py PreprocessConfig.check: "export.preprocess.mean: [...] given without std; give both (one value
    per channel), or neither ..."."""
    assert "give both (one value per channel)" in _refused({"export": {"preprocess": {"enabled": True,
                                                                                      "mean": MEAN}}})
    _preprocess_works(tmp_path, {"mean": MEAN, "std": STD})


def test_preprocess_std_length_advice_works(tmp_path):
    """config/schema.py PreprocessConfig.check: "export.preprocess.std: 2 values ... but mean has 3 ...; give one
    value per channel in both"."""
    assert "give one value per channel in both" in _refused({"export": {"preprocess": {
        "enabled": True, "mean": MEAN, "std": STD[:2]}}})
    _preprocess_works(tmp_path, {"mean": MEAN, "std": STD})


def test_register_pass_twice_advice_replace_works():
    """passes/base.py _register: "a pass named 'advice_scale' is already registered; pass replace=True to override
    it"."""
    from fx_lightning import register_pass

    register_pass("advice_scale", replace=True)(noop_pass)
    with pytest.raises(ValueError, match="pass replace=True to override it"):
        register_pass("advice_scale")(lambda gm, options, ctx: None)
    model = _image_model()
    register_pass("advice_scale", replace=True)(lambda gm, options, ctx: None)
    result = fuse(model, {"passes": {"extra": ["advice_scale"]}}, example_inputs=torch.randn(2, 3, 6, 6))
    assert_matches(model, result.graph_module, torch.randn(3, 3, 6, 6))


def test_register_builtin_pass_name_advice_configure_under_passes_works():
    """passes/base.py _register: "'fuse_conv_bn' is a built-in pass; configure it under passes.fuse_conv_bn
    instead". It was refused first with "already registered; pass replace=True to override it", advice that could
    not work (replace=True was then refused as a built-in)."""
    from fx_lightning import register_pass

    for replace in (False, True):
        with pytest.raises(ValueError) as raised:
            register_pass("fuse_conv_bn", replace=replace)(lambda gm, options, ctx: None)
        assert "configure it under passes.fuse_conv_bn instead" in str(raised.value)
        assert "replace=True" not in str(raised.value)
    model = _image_model()
    for enabled in (True, False):
        result = fuse(model, {"passes": {"fuse_conv_bn": {"enabled": enabled}}}, example_inputs=torch.randn(2, 3, 6, 6))
        assert count_batchnorms(result.graph_module) == (0 if enabled else 1)
        assert_matches(model, result.graph_module, torch.randn(3, 3, 6, 6))


def test_format_not_installed_advice_drop_it_works(tmp_path, monkeypatch):
    """export/write/writer.py require_formats: "export.formats has 'onnx' but onnxscript is not installed: pip install
    ..., or drop onnx from export.formats" (onnxscript made missing here; installing cannot be shown offline)."""
    import fx_lightning.export.write.writer as writer
    from fx_lightning import ExportError

    real = writer.missing_modules
    monkeypatch.setattr(writer, "missing_modules", lambda names: [n for n in names if n == "onnxscript"] + real(
        [n for n in names if n != "onnxscript"]))
    with pytest.raises(ExportError) as raised:
        _export_works(tmp_path / "a", {"export": {"formats": ["pt2", "onnx"]}})
    assert "or drop onnx from export.formats" in str(raised.value) and "pip install" in str(raised.value)
    _export_works(tmp_path / "b", {"export": {"formats": ["pt2"]}})


class ReshapeIntoNorm(nn.Module):
    """conv -> reshape(x.shape[0], -1) -> BatchNorm1d: folded only where the reshape's shape is known."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm1d(64), nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x).reshape(x.shape[0], -1)))


def test_unknown_shapes_advice_example_inputs_works():
    """passes/bn_layout.py (a reason in the fuse report, not a refusal): "shapes unknown around the layout
    operations: pass example_inputs so they are known"."""
    model = randomize_batchnorms(ReshapeIntoNorm()).eval()
    result = fuse(model, {"trace": {"mode": "fx"}})
    (left,) = result.report.remaining_batchnorms
    assert "pass example_inputs so" in left.reason
    x = torch.randn(2, 3, 6, 6)
    result = fuse(model, {"trace": {"mode": "fx"}}, example_inputs=x)
    assert count_batchnorms(result.graph_module) == 0 and not result.report.remaining_batchnorms
    assert_matches(model, result.graph_module, x)


class BNAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in small: BatchNorm's own forward, then ``act``. Symbolic tracing cannot follow
    BatchNorm's forward, so in fx mode it is kept whole."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


@pytest.mark.parametrize("fix", ["trace.mode-export", "batchnorm_forms"])
def test_batchnorm_kept_whole_advice_works(fix):
    """passes/bn_views.py (a reason in the fuse report): "BNAct overrides BatchNorm's forward and was kept whole
    ...: trace.mode: export (or auto) folds it, or declare it under passes.batchnorm_forms.modules"."""
    model = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), BNAct(4))).eval()
    x = torch.randn(2, 3, 6, 6)
    result = fuse(model, {"trace": {"mode": "fx"}}, example_inputs=x)
    reasons = [s.reason for s in result.report.pass_report("fuse_conv_bn").skipped]
    assert any("trace.mode: export (or auto) folds it, or declare it under passes.batchnorm_forms.modules" in r
               for r in reasons), reasons
    if fix == "trace.mode-export":
        config = {"trace": {"mode": "export"}}
    else:
        config = {"trace": {"mode": "fx"}, "passes": {"batchnorm_forms": {"modules": [
            {"module": "test_advice:BNAct", "epilogue": ["act"]}]}}}
    result = fuse(model, config, example_inputs=x)
    assert count_batchnorms(result.graph_module) == 0
    assert_matches(model, result.graph_module, x)


class PrivateBatch:
    """Keeps its tensor in a private attribute, with no to_dict(): the signature cannot read it."""

    def __init__(self, x: torch.Tensor) -> None:
        self._x = x

    @property
    def x(self) -> torch.Tensor:
        return self._x


class PublicBatch:
    """The same input with a public field."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class ReadsField(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(3, 4), nn.BatchNorm1d(4)

    def forward(self, data) -> torch.Tensor:
        return self.bn(self.lin(data.x))


def public_batch(batch: PrivateBatch) -> PublicBatch:
    """parity.input: the target's input with its tensor readable."""
    return PublicBatch(batch.x)


def tensor_of(batch: PrivateBatch) -> torch.Tensor:
    return batch.x


def test_private_attributes_advice_parity_input_function_works(tmp_path):
    """signature/signature.py derive_signature: "data is a ...PrivateBatch that keeps its tensors in private
    attributes, with no to_dict() ... Give the class public fields or a to_dict(), or set parity.input to a function
    returning the target's input with its tensors readable". It said "a function returning the tensors the target
    takes", which cannot work where the target takes the object (its forward reads data.x)."""
    from fx_lightning import FXLightningError, fuse_and_export, load_fused

    model = randomize_batchnorms(ReadsField()).eval()
    batches = [PrivateBatch(torch.randn(4, 3)), PrivateBatch(torch.randn(6, 3))]
    config = {"parity": {"input": "*"}, "export": {"formats": ["pt2"]}}
    with pytest.raises(FXLightningError) as raised:
        fuse_and_export(model, tmp_path / "a", batches=batches, config=config)
    assert "set parity.input to a function returning the target's input with its tensors readable" in \
        str(raised.value)
    with pytest.raises(FXLightningError):  # the old advice: the tensors alone are not what forward takes
        fuse_and_export(model, tmp_path / "b", batches=batches,
                        config={**config, "parity": {"input": "test_advice:tensor_of"}})
    outcome = fuse_and_export(model, tmp_path / "c", batches=batches,
                              config={**config, "parity": {"input": "test_advice:public_batch"}})
    assert outcome.parity is not None and outcome.parity.passed
    data = PublicBatch(torch.randn(5, 3))
    with torch.no_grad():
        want = copy_fp64(model)(PublicBatch(data.x.double()))
    assert rel_err(load_fused(outcome.export_dir)(data), want) <= TOL
    # Or the class given public fields: the batches as they are.
    outcome = fuse_and_export(model, tmp_path / "d", batches=[PublicBatch(b.x) for b in batches], config=config)
    assert rel_err(load_fused(outcome.export_dir)(data), want) <= TOL


# --------------------------------------------------------------------------------------------------- Triton


def _onnx_in_repository_works(model: nn.Module, repository, x: torch.Tensor) -> None:
    """The repository holds an onnxruntime model whose model.onnx computes what ``model`` does."""
    ort = pytest.importorskip("onnxruntime")
    (written,) = [m for m in repository.models if m.backend == "onnxruntime"]
    (path,) = list(written.directory.rglob("model.onnx"))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = copy_fp64(model)(x.double())
    assert rel_err(torch.from_numpy(got), want) <= TOL


def _flat_model() -> nn.Module:
    return randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(1))).eval()


def test_triton_nothing_servable_advice_export_onnx_works(tmp_path):
    """serve/triton.py plan_repository: "<export>: nothing Triton can serve: pt2: python=False: ... Export with
    export.formats including onnx or openvino (e.g. export.formats=[pt2,onnx,openvino])"."""
    pytest.importorskip("onnx")
    from fx_lightning import ExportError, fuse_and_export
    from fx_lightning.serve.triton import write_triton_repository

    model, x = _flat_model(), torch.randn(2, 3, 6, 6)
    outcome = fuse_and_export(model, tmp_path / "pt2", example_inputs=(x,), config={"export": {"formats": ["pt2"]}})
    with pytest.raises(ExportError) as raised:
        write_triton_repository(outcome.export_dir, tmp_path / "repo", python=False)
    assert "Export with export.formats including onnx or openvino" in str(raised.value)
    outcome = fuse_and_export(model, tmp_path / "both", example_inputs=(x,),
                              config={"export": {"formats": ["pt2", "onnx"]}})
    repository = write_triton_repository(outcome.export_dir, tmp_path / "repo", python=False)
    _onnx_in_repository_works(model, repository, torch.randn(3, 3, 6, 6))


class WithScalarOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor):
        y = self.fc(x)
        return y, y.sum()


def test_triton_nothing_servable_with_onnx_gives_no_advice_to_export_onnx(tmp_path):
    """serve/triton.py plan_repository: where the export already holds onnx and Triton refuses it (a scalar output),
    "Export with export.formats including onnx or openvino" could not work: it is no longer said."""
    pytest.importorskip("onnx")
    from fx_lightning import ExportError, fuse_and_export
    from fx_lightning.serve.triton import write_triton_repository

    outcome = fuse_and_export(WithScalarOutput().eval(), tmp_path / "e", example_inputs=(torch.randn(4, 5),),
                              config={"export": {"formats": ["onnx", "openvino"]}})
    with pytest.raises(ExportError) as raised:
        write_triton_repository(outcome.export_dir, tmp_path / "repo", python=False)
    assert "is a scalar" in str(raised.value) and "Export with export.formats" not in str(raised.value)


def test_triton_fixed_batch_advice_dynamic_batch_works(tmp_path):
    """serve/triton.py _max_batch_size: "triton max_batch_size: 4; onnx cannot batch: the export has a fixed batch
    (export.dynamic_batch: false) ...; allowed: 0 (or unset). Re-export with export.dynamic_batch: true to let
    Triton batch it"."""
    pytest.importorskip("onnx")
    from fx_lightning import fuse_and_export
    from fx_lightning.serve.triton import write_triton_repository

    model, x = _flat_model(), torch.randn(2, 3, 6, 6)
    outcome = fuse_and_export(model, tmp_path / "fixed", example_inputs=(x,),
                              config={"export": {"formats": ["onnx"], "dynamic_batch": False}})
    with pytest.raises(ConfigError) as raised:
        write_triton_repository(outcome.export_dir, tmp_path / "repo", max_batch_size=4)
    assert "Re-export with export.dynamic_batch: true to let Triton batch it" in str(raised.value)
    outcome = fuse_and_export(model, tmp_path / "dynamic", example_inputs=(x,),
                              config={"export": {"formats": ["onnx"], "dynamic_batch": True}})
    repository = write_triton_repository(outcome.export_dir, tmp_path / "repo", max_batch_size=4)
    (written,) = [m for m in repository.models if m.backend == "onnxruntime"]
    assert written.max_batch_size == 4
    _onnx_in_repository_works(model, repository, torch.randn(3, 3, 6, 6))


# --------------------------------------------------------------------------------------------------- MLflow


def test_mlflow_registry_not_answering_advice_works(tmp_path, monkeypatch):
    """tracking/mlflow_export.py check_destination (stage 'export.mlflow'): "export.mlflow.registry_uri: the model
    registry at ... does not answer, so 'm' cannot be registered: ... Fix the registry URI, or set register_as: null
    and registry_uri: null". It said only "set register_as: null", which the config then refused (registry_uri given
    without register_as)."""
    mlflow = pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    import lightning_helpers as H
    from fx_lightning import FXFuseCallback, load_fused

    monkeypatch.chdir(tmp_path)

    def fit(name: str, mlflow_options: dict):
        logger = MLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
                              artifact_location=str(tmp_path / "artifacts"))
        model = H.LitClassifier()
        cb = FXFuseCallback(export={"dir": str(tmp_path / name), "formats": ["pt2"], "mlflow": mlflow_options})
        H.make_trainer(tmp_path / name, [cb], logger=logger, enable_checkpointing=False).fit(model, *H.loaders())
        return model, cb

    (tmp_path / "a_file").write_text("not a directory")
    broken = {"register_as": "m", "registry_uri": f"sqlite:///{tmp_path}/a_file/registry.db"}
    with pytest.raises(ConfigError) as raised:
        fit("refused", broken)
    assert "Fix the registry URI, or set register_as: null and registry_uri: null" in str(raised.value)
    with pytest.raises(ConfigError, match="given without register_as"):  # the old advice alone
        fit("old-advice", {**broken, "register_as": None})
    # (A registry that answers, the other half, is what test_mlflow.py registers into.)
    model, cb = fit("fixed", {**broken, "register_as": None, "registry_uri": None})
    assert cb.mlflow is not None and cb.mlflow.registered is None  # logged into the run, not registered
    x = torch.randn(5, 3, 8, 8)
    assert_matches(model.backbone, load_fused(cb.export_dir), x)


@pytest.mark.parametrize("save_top_k", [None, 0], ids=["no-ModelCheckpoint", "save_top_k-0"])
def test_weights_best_after_training_advice_weights_last_works(tmp_path, save_top_k):
    """callback/trainer_data.py pick_weights (preflight off: found after training): "weights: 'best' needs a
    ModelCheckpoint callback in the Trainer, and there is none (add ModelCheckpoint(monitor=...) or use weights:
    last)" and "weights: 'best', but the ModelCheckpoint saved no checkpoint (best_model_path is empty); use weights:
    last or check the ModelCheckpoint's monitor/save settings"."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def callbacks():
        return [] if save_top_k is None else [ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="val_loss",
                                                              save_top_k=save_top_k)]

    message = _refused_fit(tmp_path, ConfigError, callbacks=callbacks(), weights="best", preflight="off",
                           export={"enabled": False})
    assert ("or use weights: last" if save_top_k is None else "use weights: last or check the ModelCheckpoint's "
            "monitor/save settings") in message
    model, cb, _ = _fit(tmp_path, "fixed", callbacks=callbacks(), weights="last", preflight="off",
                        export={"enabled": False})
    _fused_backbone_works(model, cb)


def test_mlflow_cli_advice_names_its_flags_and_works(tmp_path, capsys, monkeypatch):
    """cli/mlflow_cmd.py: the export.mlflow messages' advice, in the command's flags. "--alias: 'prod' given without
    --register; ... set --register too" (it said "set register_as too", a config key the command has no flag for),
    "--registry-uri: ... given without --register; ... set --register too, or leave out --registry-uri" (it said
    "registry_uri: null"), "--format: 'openvino' is not in the export; it holds pt2 (or leave out --format ...)",
    and "give --tracking-uri (or set MLFLOW_TRACKING_URI)": each followed, the command logs the export."""
    mlflow = pytest.importorskip("mlflow")
    from fx_lightning import fuse_and_export
    from fx_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model, x = _image_model(), torch.randn(3, 3, 6, 6)
    outcome = fuse_and_export(model, tmp_path / "export", example_inputs=(x,), config={"export": {"formats": ["pt2"]}})
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    base = ["mlflow", str(outcome.export_dir)]

    def refused(argv) -> str:
        capsys.readouterr()
        assert main(argv) == 2
        captured = capsys.readouterr()
        return " ".join((captured.err + captured.out).split())  # the console wraps lines

    assert "give --tracking-uri (or set MLFLOW_TRACKING_URI)" in refused(base)
    assert "set --register too" in refused([*base, "--tracking-uri", uri, "--alias", "prod"])
    assert "set --register too, or leave out --registry-uri" in refused(
        [*base, "--tracking-uri", uri, "--registry-uri", f"sqlite:///{tmp_path}/registry.db"])
    assert "(or leave out --format for its selection)" in refused([*base, "--tracking-uri", uri, "--format", "onnx"])
    # Followed: --register with the alias; MLFLOW_TRACKING_URI for --tracking-uri; no --format.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert main([*base, "--alias", "prod", "--register", "advised"]) == 0
    version = mlflow.MlflowClient(uri).get_model_version_by_alias("advised", "prod")
    # Logged and registered (what the pyfunc then answers is test_mlflow.py's).
    assert str(version.version) == "1" and version.tags["fx_lightning.served_artifact"] == "pt2"


def test_export_dependencies_stage_advice_drop_the_format_works(tmp_path, monkeypatch):
    """callback/preflight.py FIXES[export dependencies]: "export.formats has 'onnx' but onnxscript is not installed:
    ... Fix: install what is named above, or drop that format from export.formats" (onnxscript made missing here;
    installing cannot be shown offline)."""
    import fx_lightning.export.write.writer as writer
    from fx_lightning import ExportError, load_fused

    real = writer.missing_modules
    monkeypatch.setattr(writer, "missing_modules", lambda names: [n for n in names if n == "onnxscript"] + real(
        [n for n in names if n != "onnxscript"]))
    message = _refused_fit(tmp_path, ExportError, export={"formats": ["graph_module", "onnx"]})
    assert "stage 'export dependencies'" in message
    assert "Fix: install what is named above, or drop that format from export.formats" in message
    model, cb, _ = _fit(tmp_path, "fixed", export={"formats": ["graph_module"]})
    _fused_backbone_works(model, cb)
    assert_matches(model.backbone, load_fused(cb.export_dir), torch.randn(5, 3, 8, 8))


def test_cli_model_without_load_from_checkpoint_advice_works(tmp_path, capsys):
    """cli/common.py load_lightning_module: "--model: <class 'torch.nn.modules.linear.Linear'> has no
    load_from_checkpoint; give a LightningModule subclass"."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fx_lightning import load_fused
    from fx_lightning.cli import main

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, save_top_k=0)
    model, _, _ = _fit(tmp_path, "fit", callbacks=[ckpt], export={"enabled": False})
    command = ["fuse", ckpt.last_model_path, "--input-shape", "2,3,8,8", "export.formats=[pt2]"]
    capsys.readouterr()
    assert main([*command, "--model", "torch.nn:Linear", "-o", str(tmp_path / "a")]) == 2
    assert "give a LightningModule subclass" in capsys.readouterr().err
    assert main([*command, "--model", "lightning_helpers:LitClassifier", "-o", str(tmp_path / "b")]) == 0
    assert_matches(model.backbone, load_fused(tmp_path / "b"), torch.randn(5, 3, 8, 8))


class _Leaky(nn.Module):
    """snntorch's ``Leaky(init_hidden=True)`` in torch alone: the membrane potential is a buffer the calls replace."""

    def __init__(self, beta: float = 0.5) -> None:
        super().__init__()
        self.beta = beta
        self.register_buffer("mem", torch.zeros(1), persistent=False)

    def reset(self) -> None:
        self.mem = torch.zeros_like(self.mem)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mem.shape == x.shape:
            self.mem = torch.zeros_like(x)
        self.mem = self.beta * self.mem + x
        spike = torch.sigmoid(4 * (self.mem - 1.0))  # a surrogate spike, differentiable
        self.mem = self.mem - spike
        return spike


def _spike_rates(net: nn.Module, x: torch.Tensor, steps: int = 4) -> torch.Tensor:
    """snntorch's tutorials: ``utils.reset(net)``, then the network called once per time step."""
    for m in net.modules():
        if isinstance(m, _Leaky):
            m.reset()
    return torch.stack([net(x) for _ in range(steps)]).sum(0)


def _spiking_lit(steps_call_forward: bool):
    import lightning_helpers as H

    class LitSpiking(H.CrossEntropySteps):
        lr = 0.05

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), _Leaky(),
                                     nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, H.NUM_CLASSES), _Leaky())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _spike_rates(self.net, x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x) if steps_call_forward else _spike_rates(self.net, x), y)

    return LitSpiking()


def test_a_target_answering_from_state_its_calls_left_is_refused_before_training_with_advice_that_works(tmp_path):
    """snntorch (held-out check 10): the steps reset the neurons and call ``self.net(x)`` once per time step; each
    call answers from the membrane potential the one before left in a buffer. The preflight crashed deep-copying that
    buffer (it holds the training step's graph), and with the preflight off the artifact, which runs each call
    alone, was wrong (relative error 0.49). Now refused before training, naming the buffers; the advice (a forward
    that resets and runs every step, called by the steps, target '') fuses that forward, which matches."""
    import lightning_helpers as H

    message = _refused_fit(tmp_path, ExportError, model=_spiking_lit(False), export={"enabled": False})
    assert "before the first optimizer step; nothing was trained" in message, message
    assert "answers from state its earlier calls left" in message and "net.2.mem, net.6.mem" in message, message
    assert "set target: ''" in message and "call it in the steps as self(x)" in message, message
    model, cb, _ = _fit(tmp_path, "fixed", model=_spiking_lit(True), target="", export={"enabled": False})
    assert cb.result is not None and cb.error is None
    x = torch.randn(16, 3, 8, 8)
    assert H.rel_err(cb.result.graph_module(x), H.fp64_copy(model)(x.double())) < 1e-5
    # The reset keeps the last batch's shape (zeros_like(mem)), so the batch size is fixed in the capture, and said:
    # another is refused by name, never answered wrongly.
    assert "captured for x dim 0 = 16 only" in cb.summary
    with pytest.raises(Exception, match="16"):
        cb.result.graph_module(torch.randn(5, 3, 8, 8))


class _Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 3, 3, padding=1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.body(x) * (1 + t.float().view(-1, 1, 1, 1) / 10)


class _Diffusion(nn.Module):
    """denoising-diffusion-pytorch's ``GaussianDiffusion``: its forward is the training loss, on a timestep and
    noise drawn at random; sampling calls the denoiser ``model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Denoiser()

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, 10, (img.shape[0],))
        noise = torch.randn_like(img)
        scale = t.float().view(-1, 1, 1, 1) / 10
        return F.mse_loss(self.model(img * (1 - scale) + noise * scale, t), noise)


def _diffusion_lit():
    import lightning.pytorch as pl

    class LitDiffusion(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.diffusion = _Diffusion()

        def training_step(self, batch, batch_idx):
            return self.diffusion(batch[0])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.diffusion(batch[0]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return LitDiffusion()


def test_every_output_drawn_at_random_fuses_the_deterministic_module_inside(tmp_path):
    """denoising-diffusion-pytorch (held-out check 10): the steps call the diffusion wrapper, whose only output is a
    loss on noise drawn at random: training was stopped (nothing deterministic to compare), with advice that gave no
    artifact. Now the module inside that holds the weights and answers the same run after run (the denoiser, which
    sampling calls) is fused, on the calls the wrapper made, and said; with the wrapper set as the target, the
    refusal names that module, and the setting works."""
    import lightning_helpers as H
    from fx_lightning import ParityError

    model, cb, _ = _fit(tmp_path, "zero-config", model=_diffusion_lit(), export={"enabled": False})
    assert cb.result is not None and cb.error is None and cb.outcome.target == "diffusion.model"
    assert cb.result.report.batchnorms_folded == 1
    assert "every output of diffusion is a loss drawn at random" in cb.summary and "fused diffusion.model inside it" in \
        cb.summary, cb.summary
    reference = H.fp64_copy(model.diffusion.model)
    for batch in (1, 5):
        x, t = torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))
        assert H.rel_err(cb.result.graph_module(x, t), reference(x.double(), t)) < 1e-5

    message = _refused_fit(tmp_path, ParityError, model=_diffusion_lit(), target="diffusion",
                           export={"enabled": False})
    assert "before the first optimizer step; nothing was trained" in message, message
    found = re.search(r"Fix: set target: ([\w.]+) \(it holds ([\d,]+) of the ([\d,]+) parameters", message)
    assert found and found.group(1) == "diffusion.model" and found.group(2) == found.group(3), message
    _, cb, _ = _fit(tmp_path, "fixed", model=_diffusion_lit(), target=found.group(1), export={"enabled": False})
    assert cb.result is not None and cb.error is None


def test_the_module_inside_is_calibrated_and_gated_on_the_calls_the_wrapper_made(tmp_path):
    """The inner target with a lossy variant: int8 is calibrated on the denoiser's own calls (an image and a
    timestep, made by the wrapper inside the training steps) and judged on those of validation, not on the
    wrapper's batches (an image alone, which the denoiser cannot take); kept only where its gate passed, and then
    within that gate of the fp64 denoiser."""
    import torch.nn.functional as F

    import lightning_helpers as H
    from fx_lightning import load_fused
    from fx_lightning.export import read_manifest

    model, cb, _ = _fit(tmp_path, "int8", model=_diffusion_lit(), export={"formats": ["pt2"]},
                        passes={"quantize_int8": {"enabled": True, "min_cosine": 0.9}})
    assert cb.error is None and cb.outcome.target == "diffusion.model", cb.summary
    outcomes = read_manifest(cb.export_dir).variants["int8"]
    assert [o.entry for o in outcomes] == ["pt2-int8"], outcomes
    outcome = outcomes[0]
    assert outcome.error is None and outcome.skipped is None and outcome.gate is not None, outcome
    if outcome.kept:
        reference = H.fp64_copy(model.diffusion.model)
        x, t = torch.randn(5, 3, 8, 8), torch.randint(0, 10, (5,))
        out, ref = load_fused(cb.export_dir, "pt2-int8")(x, t), reference(x.double(), t)
        assert F.cosine_similarity(out.double().flatten(1), ref.flatten(1)).min() >= 0.9


def test_a_crash_in_the_capture_stage_that_is_no_trace_failure_gives_no_advice_it_cannot_keep(tmp_path):
    """snntorch before its fix (held-out check 10): the working copy's deepcopy raised, and the refusal ended with
    "Fix: see the fixes listed above (trace.mode, trace.leaf_modules, trace.autowrap_functions)": nothing was listed,
    and no trace setting changes a copy that fails. Such an error now gives the cause and no advice."""
    import lightning_helpers as H

    class Uncopyable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3 * 8 * 8, H.NUM_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x.flatten(1))

        def __deepcopy__(self, memo):
            raise RuntimeError("this module cannot be copied")

    class Lit(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = Uncopyable()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone(x)

    message = _refused_fit(tmp_path, TraceError, model=Lit(), export={"enabled": False})
    assert "RuntimeError: this module cannot be copied" in message and "stage 'capture'" in message, message
    assert "Fix:" not in message, message


def test_outputs_equal_to_themselves_are_no_state_even_when_infinite(tmp_path):
    """Review of the state check: an output of -inf (a masked logit) is the same run after run, but as numbers
    inf - inf is NaN, so the rerun was taken for state between calls and training was stopped. Equal infinities are
    equal; the model fuses."""
    import lightning_helpers as H

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = H.TinyBackbone(8)
            self.head = nn.Linear(8, H.NUM_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = self.head(self.body(x))
            return torch.cat([logits, torch.full_like(logits[:, :1], float("-inf"))], dim=1)  # a masked class

    class Lit(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = Masked()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone(x)

    model, cb, _ = _fit(tmp_path, "fused", model=Lit(), export={"enabled": False})
    assert cb.result is not None and cb.error is None
    x = torch.randn(3, 3, 8, 8)
    got, want = cb.result.graph_module(x), H.fp64_copy(model.backbone)(x.double())
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and H.rel_err(got[:, :-1], want[:, :-1]) < 1e-5


class _Observed(nn.Module):
    """An observer as quantisation-aware training keeps one: while ``enabled`` it writes a running value into a
    buffer on every call (eval too), which moves the outputs; training switches it off."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("enabled", torch.ones(()))
        self.register_buffer("running", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(self.enabled):
            self.running.add_(x.detach().abs().mean())
        return x + self.running


def test_state_written_in_place_is_left_to_the_end_of_fit_and_works_once_training_froze_it(tmp_path):
    """Review of the state check: outputs that change between calls because a buffer is written in place (an
    observer) are not proven to fail before training (training may switch it off, as here after the first epoch):
    the preflight says so and training goes on; at the end of fit the frozen model fuses."""
    import warnings

    import lightning_helpers as H
    from fx_lightning import FXFuseCallback

    class Lit(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(H.TinyBackbone(8), _Observed(), nn.Linear(8, H.NUM_CLASSES))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone(x)

        def on_train_epoch_end(self) -> None:
            self.backbone[1].enabled.fill_(0.0)  # observers frozen after the first epoch

    model = Lit()
    cb = FXFuseCallback(export={"enabled": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        H.make_trainer(tmp_path, [cb], enable_checkpointing=False).fit(model, *H.loaders())
    lines = [str(w.message) for w in caught if "preflight (" in str(w.message)]
    assert lines and "not proven" in lines[0] and "wrote into the buffers backbone.1.running" in lines[0], lines
    assert cb.result is not None and cb.error is None
    x = torch.randn(3, 3, 8, 8)
    assert H.rel_err(cb.result.graph_module(x), H.fp64_copy(model.backbone)(x.double())) < 1e-5


def test_a_sampled_prediction_is_not_taken_for_a_loss_and_the_model_inside_is_only_advised(tmp_path):
    """Review of the inner target: only a target returning losses drawn at random (a diffusion model's training
    loss) has the module inside fused in its place; a prediction sampled in eval (dropout kept on, MC dropout) is
    what the user serves, so it stays refused before training, with the module inside as the advice."""
    from fx_lightning import ParityError
    import lightning_helpers as H

    class AlwaysDropout(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(x, 0.5, training=True)

    class Lit(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(H.TinyBackbone(8), AlwaysDropout(), nn.Linear(8, H.NUM_CLASSES))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone(x)

    message = _refused_fit(tmp_path, ParityError, model=Lit(), export={"enabled": False})
    assert "before the first optimizer step; nothing was trained" in message, message
    assert "Fix: set target: backbone.0 (it holds" in message, message
