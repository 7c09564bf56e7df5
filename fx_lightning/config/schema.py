"""The configuration schema: its enums and dataclasses, and the value checks each dataclass makes of itself.

Types are OmegaConf's to check (:mod:`fx_lightning.config.loading` merges sources into this schema); what a
type cannot say (a range, a set, an import path that must import) each dataclass says in its ``check()``,
which raises ``ValueError("<key relative to the dataclass>: <what is wrong and what is allowed>")`` as the
pass options do (:class:`fx_lightning.passes.PassOptions`). The loader prefixes the full key.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import posixpath
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Iterable, List, Optional

from fx_lightning.common.imports import exception_text, import_checked
from fx_lightning.errors import OnError
from fx_lightning.formats import FORMATS
from fx_lightning.passes import DEFAULT_ORDER, USER_PASSES, builtin_passes
from fx_lightning.parity.options import OnFailure, ParityConfig, ParityData
from fx_lightning.variants import VARIANTS

__all__ = [
    "TraceMode",
    "WeightsSource",
    "OnError",
    "OnFailure",
    "Preflight",
    "FormatFailure",
    "Selection",
    "Strategy",
    "Traffic",
    "ExportFormat",
    "ParityData",
    "InputDtype",
    "Layout",
    "ChannelOrder",
    "TraceConfig",
    "ExtraPassConfig",
    "PassesConfig",
    "ParityConfig",
    "PreprocessConfig",
    "MlflowConfig",
    "ExportConfig",
    "FuseConfig",
]


# ------------------------------------------------------------------------------------------------ enums


def _str_enum(name: str, members: Iterable[str], doc: str) -> Any:
    """A ``str`` Enum whose members are named as their values: the one style of every enum here.

    OmegaConf validates an enum value by member *name* and rejects ``typing.Literal``; a ``str`` member
    compares equal to its value; the functional API allows members named after keywords (``raise``:
    ``OnError["raise"]``); ``module`` makes members picklable by name (Lightning copies callbacks across
    processes); ``str()`` and f-strings give the value (``NHWC``, not ``Layout.NHWC``), as the plain strings they
    stand for (the manifest's ``Preprocess`` fields) did.
    """
    cls = Enum(name, [(m, m) for m in members], type=str, module=__name__, qualname=name)  # type: ignore[misc]
    cls.__doc__ = doc
    cls.__str__ = lambda self: str(self.value)  # type: ignore[method-assign]
    cls.__format__ = lambda self, spec: format(str(self.value), spec)  # type: ignore[method-assign]
    return cls


TraceMode = _str_enum("TraceMode", ["auto", "fx", "export"], "How the target is captured: auto (torch.fx, then "
                      "torch.export), fx or export.")

WeightsSource = _str_enum("WeightsSource", ["last", "best"], "Which weights are fused: the last ones, or the "
                          "ModelCheckpoint's best checkpoint (loaded into a copy).")

# One member per export format record (fx_lightning/formats/), in load_fused's order of preference.
ExportFormat = _str_enum("ExportFormat", FORMATS, "The export formats: " + ", ".join(FORMATS) + ".")

Preflight = _str_enum("Preflight", ["full", "capture", "off"], (
    "What the callback proves before the first training step. ``full``: the end of fit's own pipeline once on "
    "the untrained model, with the batches parity will read (capture, passes, parity measured, every export "
    "format, the variants and the selection, into a temporary directory); ``capture``: the target resolves and "
    "captures; ``off``: nothing."))

FormatFailure = _str_enum("FormatFailure", ["skip", "raise"], (
    "What a format that cannot be written or fails its check does to the export: skip (the other formats are "
    "exported, the manifest and a warning say why it is missing) or raise (nothing is exported)."))

Selection = _str_enum("Selection", ["preference", "fastest"], (
    "Which artifact ``load_fused(dir)`` loads by default: ``preference`` (pt2 first), or ``fastest``: every "
    "artifact timed side by side after export, the fastest that passes its check."))

Strategy = _str_enum("Strategy", ["min_latency", "max_throughput"], (
    "What ``export.select: fastest`` picks for: ``min_latency``: the fastest at ``select_batch_size``; "
    "``max_throughput``: the most samples per second over the throughput sweep (batch sizes 1, 2, 4... until "
    "throughput stops growing), with a p99 within ``latency_budget_ms`` when one is set."))

Traffic = _str_enum("Traffic", ["idle", "back_to_back"], (
    "How requests arrive, which decides the fastest artifact and its runtime settings: ``idle``: each after an idle "
    "gap (the runtime's threads have gone to sleep; sparse traffic), ``back_to_back``: one right after another."))

# export.preprocess: what a client of the export sends (the raw input the prologue takes).
InputDtype = _str_enum("InputDtype", ["uint8", "float32"], "The raw input's dtype: uint8 pixels or float32 values.")
Layout = _str_enum("Layout", ["NCHW", "NHWC"], "The raw input's axes: channels first (NCHW) or last (NHWC).")
ChannelOrder = _str_enum("ChannelOrder", ["RGB", "BGR"], "The raw input's channel order (BGR: OpenCV's).")


# ----------------------------------------------------------------------------------------- dataclasses


@dataclass
class TraceConfig:
    mode: TraceMode = TraceMode.auto
    # Import paths ("pkg.mod:Class" or "pkg.mod.Class") of modules to keep opaque while tracing.
    leaf_modules: List[str] = field(default_factory=list)
    # Import paths of free functions to record as single calls instead of tracing through them.
    autowrap_functions: List[str] = field(default_factory=list)
    autowrap_modules: List[str] = field(default_factory=lambda: ["math"])
    # Arguments of forward to specialise on (symbolic tracing's concrete_args).
    concrete_args: Dict[str, Any] = field(default_factory=dict)
    # Sizes that never varied in the observed calls are resized once in an experiment; where the model takes the
    # other size they stay dynamic (an image's height and width, a sequence's length), else they are fixed. Off:
    # every size seen once is fixed (a model the experiment would mislead, or a server that wants fixed dims).
    probe_sizes: bool = True

    def check(self) -> None:
        """Every import path imports: leaf modules to ``torch.nn.Module`` classes, functions to callables."""
        import torch

        for i, path in enumerate(self.leaf_modules):
            obj = import_checked(path, f"leaf_modules[{i}]")
            if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
                raise ValueError(f"leaf_modules[{i}]: {path!r} is not a torch.nn.Module subclass.")
        for i, path in enumerate(self.autowrap_functions):
            import_checked(path, f"autowrap_functions[{i}]", callable_required=True)
        for i, path in enumerate(self.autowrap_modules):
            try:
                if not path or path.startswith("."):
                    raise ImportError("not an absolute module name")
                importlib.import_module(path)
            except Exception as exc:  # noqa: BLE001 - importing user code may raise anything
                raise ValueError(
                    f"autowrap_modules[{i}]: cannot import module {path!r}: {exception_text(exc)}."
                ) from (None if isinstance(exc, ImportError) else exc)


@dataclass
class ExtraPassConfig:
    """A user pass: a name given to ``register_pass`` or an import path ``"pkg.module:function"``."""

    name: str = "???"
    enabled: bool = True
    options: Dict[str, Any] = field(default_factory=dict)


def _passes_schema() -> type:
    """``PassesConfig``: one field per built-in pass (its options dataclass), in the default order, with the
    user passes (``extra``) at their place in it, then one per lossy variant (its options, under the key it
    declares). Derived from the pass and variant declarations, so a new one needs no edit here."""
    builtins = {spec.name: spec for spec in builtin_passes()}
    fields: List[Any] = []
    for name in DEFAULT_ORDER:
        if name == USER_PASSES:
            fields.append((USER_PASSES, List[ExtraPassConfig], field(default_factory=list)))
        else:
            fields.append((name, builtins[name].options_type, field(default_factory=builtins[name].options_type)))
    fields += [(v.key, v.options_type, field(default_factory=v.options_type)) for v in VARIANTS.values()]
    cls = dataclasses.make_dataclass("PassesConfig", fields)
    cls.__module__ = __name__  # picklable by name (Lightning copies callbacks across processes)
    cls.__doc__ = ("Options of every built-in pass, in order (``extra``: the user's passes, run in place), then of "
                   "each lossy variant.")
    return cls


PassesConfig: Any = _passes_schema()


@dataclass
class PreprocessConfig:
    """``export.preprocess``: the input normalisation compiled into the exported graph, so a client sends raw
    pixels: ``model_input = (float32(raw) [NHWC->NCHW] [BGR->RGB] * scale - mean[c]) / std[c]``."""

    enabled: bool = False
    # Per channel, both or neither; null: found in the datamodule's validation transform (Normalize), with its
    # scale (ToTensor: 1/255), or a ConfigError before training when there is none.
    mean: Optional[List[float]] = None
    std: Optional[List[float]] = None
    scale: float = 1.0 / 255.0
    input_dtype: InputDtype = InputDtype.uint8
    layout: Layout = Layout.NCHW
    channel_order: ChannelOrder = ChannelOrder.RGB

    def check(self) -> None:
        """Finite values, std and scale > 0, mean and std given together with the same length (the input's
        channel count is checked at export, where the input is known)."""
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"scale: must be a finite number > 0 (1/255 for 0-255 pixels), got {self.scale}.")
        for name in ("mean", "std"):
            values = getattr(self, name)
            if values is not None and (not values or not all(math.isfinite(v) for v in values)):
                raise ValueError(f"{name}: one finite number per channel, or null, got {list(values)}.")
        if self.std is not None and any(v <= 0 for v in self.std):
            raise ValueError(f"std: every value must be > 0, got {list(self.std)}.")
        if (self.mean is None) != (self.std is None):
            given, missing = ("mean", "std") if self.std is None else ("std", "mean")
            raise ValueError(f"{given}: {list(getattr(self, given))} given without {missing}; give both (one value "
                             "per channel), or neither to take them from the datamodule's validation transform.")
        if self.mean is not None and self.std is not None and len(self.mean) != len(self.std):
            raise ValueError(f"std: {len(self.std)} values {list(self.std)} but mean has {len(self.mean)} "
                             f"{list(self.mean)}; give one value per channel in both.")


# MLflow's rules for the names export.mlflow gives it (mlflow.utils.validation): checked here, before training.
_LOGGED_MODEL_NAME_FORBIDDEN = ("/", ":", ".", "%", '"', "'")
_ALIAS = re.compile(r"^[\w\-]{1,255}$")
_VERSION_ALIAS = re.compile(r"^[vV]\d+$")


@dataclass
class MlflowConfig:
    """``export.mlflow``: the verified export logged into the Trainer's ``MLFlowLogger`` run as an MLflow model (a
    pyfunc over the export's checked loader), and optionally registered as a new model version."""

    # null: on when the Trainer has an MLFlowLogger; true: one is required (refused before training without one);
    # false: off.
    enabled: Optional[bool] = None
    # The logged model's name in the run: runs:/<run_id>/<artifact_path>.
    artifact_path: str = "fx_fused"
    # The artifact the pyfunc serves: a format or variant entry of the export (pt2, onnx, openvino-int8...);
    # null: the export's selection (the fastest that passed, for batched requests).
    format: Optional[str] = None
    # A registered model name: the logged model becomes a new version of it, tagged with the export's figures.
    register_as: Optional[str] = None
    # An alias to point at that version (e.g. candidate); needs register_as.
    alias: Optional[str] = None
    # The model registry's URI, when it is not the tracking server's; null: MLflow's own ($MLFLOW_REGISTRY_URI, else
    # the MLFlowLogger's tracking server).
    registry_uri: Optional[str] = None

    def check(self) -> None:
        """The names MLflow would refuse, refused here: ``artifact_path`` a logged model's name, ``register_as`` a
        registered model's, ``alias`` an alias (with ``register_as``); ``format`` a format or variant entry."""
        if not self.artifact_path or any(c in self.artifact_path for c in _LOGGED_MODEL_NAME_FORBIDDEN):
            raise ValueError(f"artifact_path: {self.artifact_path!r}; allowed: a non-empty name without "
                             f"{' '.join(_LOGGED_MODEL_NAME_FORBIDDEN)} (MLflow's rule for a logged model's name).")
        if self.register_as is not None:
            name = self.register_as
            normal = posixpath.normpath(name)
            if (not name.strip() or "/" in name or ":" in name or normal != name or normal == "."
                    or normal.startswith("..")):
                raise ValueError(f"register_as: {name!r}; allowed: a registered model name without '/' or ':', not "
                                 "'.' nor starting with '..' (MLflow's rules), or null not to register.")
        if self.registry_uri is not None and self.register_as is None:
            raise ValueError(f"registry_uri: {self.registry_uri!r} given without register_as; nothing would be "
                             "registered: set register_as too, or registry_uri: null.")
        if self.alias is not None:
            if self.register_as is None:
                raise ValueError(f"alias: {self.alias!r} given without register_as; an alias points at a registered "
                                 "model version: set register_as too.")
            if not _ALIAS.match(self.alias) or _VERSION_ALIAS.match(self.alias) or self.alias.lower() == "latest":
                raise ValueError(f"alias: {self.alias!r}; allowed: 1-255 letters, digits, '_' or '-', not 'latest' "
                                 "nor a version name such as 'v3' (MLflow reserves both).")
        if self.format is not None:
            base, _, variant = self.format.partition("-")
            if base not in FORMATS or (variant and variant not in {v.name for v in VARIANTS.values()}):
                raise ValueError(f"format: {self.format!r}; allowed: a format of the export ({', '.join(FORMATS)}), "
                                 "a variant entry <format>-<variant> (variants: "
                                 f"{', '.join(v.name for v in VARIANTS.values())}), or null for the export's selection.")


@dataclass
class ExportConfig:
    enabled: bool = True
    # null: <trainer.log_dir>/fx_fused (callback) or ./fx_fused (CLI).
    dir: Optional[str] = None
    formats: List[ExportFormat] = field(
        default_factory=lambda: [ExportFormat.graph_module, ExportFormat.pt2]
    )
    # The artifacts take any number of samples, and the torch.export capture marks the sample axis dynamic.
    dynamic_batch: bool = True
    overwrite: bool = True
    onnx_opset: Optional[int] = None
    # aoti: one package per batch size listed (compiled for it: faster), or one with a dynamic batch.
    aoti_batch_sizes: List[int] = field(default_factory=list)
    on_format_failure: FormatFailure = FormatFailure["skip"]
    select: Selection = Selection.preference
    # The batch size and traffic the default artifact is chosen for; the manifest records the fastest for each
    # batch size timed (1 and this one) and each traffic, and load_fused(dir, batch_size=, traffic=) picks from it.
    select_batch_size: int = 1
    select_traffic: Traffic = Traffic.idle
    # min_latency (at select_batch_size) or max_throughput (over the throughput sweep); both are recorded.
    select_strategy: Strategy = Strategy.min_latency
    # max_throughput only: the p99 latency (ms) a batch may take at most; no artifact within it is an error.
    latency_budget_ms: Optional[float] = None
    # The raw-input prologue compiled into every artifact (off by default).
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    # Class names of the first output's columns (manifest ``labels``); null: the datamodule's ``classes``.
    labels: Optional[List[str]] = None
    # The export logged into an MLflow run (and registry) when the Trainer has an MLFlowLogger.
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # Calls no observed call made, one argument away from them (forward's default where the calls passed another
    # value; a bool flag's other value: rev=True), each captured, proven and exported beside the artifact
    # (forms/<argument>=<value>): load_fused sends each call to its form.
    call_forms: bool = True

    def check(self) -> None:
        """Formats listed (when enabled) and once each; batch sizes positive (and distinct); opset in range."""
        if self.enabled and not self.formats:
            raise ValueError(
                "formats: empty while export.enabled is true; allowed: "
                f"{', '.join(f.name for f in ExportFormat)} (or set export.enabled: false)."
            )
        for i, fmt in enumerate(self.formats):
            if fmt in self.formats[:i]:
                raise ValueError(f"formats[{i}]: {fmt.name!r} is listed twice.")
        sizes = self.aoti_batch_sizes
        if any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
            raise ValueError(f"aoti_batch_sizes: positive and distinct batch sizes, or [] for one dynamic-batch "
                             f"package; got {list(sizes)}.")
        if self.mlflow.enabled and not self.enabled:
            raise ValueError("mlflow.enabled: true while export.enabled is false: there would be nothing to log; set "
                             "export.enabled: true, or mlflow.enabled: null or false.")
        if self.select_batch_size < 1:
            raise ValueError(f"select_batch_size: must be >= 1, got {self.select_batch_size}.")
        budget = self.latency_budget_ms
        if budget is not None and (isinstance(budget, bool) or not math.isfinite(budget) or budget <= 0):
            raise ValueError(f"latency_budget_ms: {budget!r}; allowed: a number of milliseconds > 0, or null.")
        if budget is not None and self.select_strategy is not Strategy.max_throughput:
            # select: fastest too where it is not set: the strategy alone is refused next (it picks from timings).
            also = "" if self.select is Selection.fastest else " and select: fastest"
            raise ValueError(f"latency_budget_ms: {budget!r} with select_strategy: {self.select_strategy.value}; a p99 "
                             f"budget bounds the max_throughput pick: set select_strategy: max_throughput{also}, or "
                             "latency_budget_ms: null.")
        if self.select is not Selection.fastest and (self.select_strategy is not Strategy.min_latency
                                                     or budget is not None):
            raise ValueError(f"select_strategy: {self.select_strategy.value} with select: {self.select.value}; a "
                             "strategy picks from timings, which only select: fastest takes: set select: fastest.")
        if self.onnx_opset is not None and not 7 <= self.onnx_opset <= 30:
            raise ValueError(f"onnx_opset: must be between 7 and 30 or null, got {self.onnx_opset}.")


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|[0-9]+))*$")  # "model.0.conv": an index


@dataclass
class FuseConfig:
    # Dotted attribute of the LightningModule to fuse; null: `backbone` if present, else the module; "": the whole
    # module, even when it has a `backbone` (what manifests of whole-module exports record).
    target: Optional[str] = None
    weights: WeightsSource = WeightsSource.last
    trace: TraceConfig = field(default_factory=TraceConfig)
    passes: PassesConfig = field(default_factory=PassesConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    on_error: OnError = OnError["raise"]
    preflight: Preflight = Preflight.full
    # Where fusion, parity and export run: auto (the device training ran on), cpu, or a torch device
    # ("cuda", "cuda:1"). Exported artifacts are built for it (the manifest records each one's device).
    device: str = "auto"

    def check(self) -> None:
        """The top-level values: ``target`` a dotted attribute path, ``device`` auto or a torch device. The
        nested sections check themselves (the loader calls every node's ``check()``)."""
        if self.target and not _DOTTED.match(self.target):
            raise ValueError(
                f"target: {self.target!r} is not a dotted attribute path (e.g. 'backbone', 'model.encoder' or 'net.0'); "
                "use null for the default (backbone if present, else the whole module), or '' for the whole module."
            )
        if self.device == "auto":
            return
        import torch

        try:
            torch.device(self.device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(
                f"device: {self.device!r} is not a torch device ({str(exc).splitlines()[0]}); allowed: auto (the "
                "device training ran on), cpu, or a torch device such as cuda or cuda:1."
            ) from None

