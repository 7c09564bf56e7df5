"""The OmegaConf structured schema for fx-lightning, and its loading and validation.

Every entry point (``fuse()``, ``FXFuseCallback``, the CLI, Hydra) goes through :func:`load_config`, so a
typo or a bad value fails the same way everywhere: a :class:`ConfigError` that names the full key, the
value given and what is allowed, raised before any work (or training step) starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import re
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fx_lightning._imports import exception_text, import_object
from fx_lightning.errors import ConfigError
from fx_lightning.export.formats import FORMATS
from fx_lightning.passes import DEFAULT_ORDER, USER_PASSES, Stage, builtin_passes, resolve_pass

__all__ = [
    "TraceMode",
    "WeightsSource",
    "OnError",
    "Preflight",
    "FormatFailure",
    "Selection",
    "ExportFormat",
    "ParityData",
    "TraceConfig",
    "ExtraPassConfig",
    "PassesConfig",
    "ParityConfig",
    "ExportConfig",
    "FuseConfig",
    "ConfigError",
    "ConfigLike",
    "load_config",
    "to_yaml",
    "to_container",
    "register_hydra_configs",
]


# OmegaConf validates enum values by member *name*, and rejects typing.Literal: hence str Enums with
# lower-case names. ``raise`` is a keyword, so those two use the functional Enum API.
class TraceMode(str, Enum):
    auto = "auto"
    fx = "fx"
    export = "export"


class WeightsSource(str, Enum):
    last = "last"
    best = "best"


OnError = Enum("OnError", {"raise": "raise", "warn": "warn"}, type=str)  # type: ignore[misc]
OnError.__doc__ = "What to do when a step fails: raise, or warn and carry on."


# One member per export format record (fx_lightning/export/formats/), in load_fused's order of preference.
ExportFormat = Enum("ExportFormat", {name: name for name in FORMATS}, type=str)  # type: ignore[misc]
ExportFormat.__doc__ = "The export formats: " + ", ".join(FORMATS) + "."


class Preflight(str, Enum):
    """What the callback proves before the first training step. ``full``: the whole pipeline once on the
    untrained model (capture, passes, a parity smoke run on one batch, every export format written to a
    temporary directory and loaded back); ``capture``: the target resolves and captures; ``off``: nothing."""

    full = "full"
    capture = "capture"
    off = "off"


FormatFailure = Enum("FormatFailure", {"skip": "skip", "raise": "raise"}, type=str)  # type: ignore[misc]
FormatFailure.__doc__ = ("What a format that cannot be written or fails its check does to the export: skip (the "
                         "other formats are exported, the manifest and a warning say why it is missing) or raise "
                         "(nothing is exported).")


class Selection(str, Enum):
    """Which artifact ``load_fused(dir)`` loads by default: ``preference`` (pt2 first), or ``fastest``: every
    artifact timed side by side after export, the fastest that passes its check."""

    preference = "preference"
    fastest = "fastest"


class ParityData(str, Enum):
    """Where parity batches come from. ``auto``: validation, else training data, else example_input_array."""

    auto = "auto"
    val = "val"
    train = "train"
    example = "example"


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
    # For mode=export: mark dim 0 of every tensor input dynamic.
    dynamic_batch: bool = True


@dataclass
class ExtraPassConfig:
    """A user pass: a name given to ``register_pass`` or an import path ``"pkg.module:function"``."""

    name: str = "???"
    enabled: bool = True
    options: Dict[str, Any] = field(default_factory=dict)


def _passes_schema() -> type:
    """``PassesConfig``: one field per built-in pass (its options dataclass), in the default order, with the
    user passes (``extra``) at their place in it. Derived from the pass declarations, so a new built-in
    pass needs no edit here."""
    builtins = {spec.name: spec for spec in builtin_passes()}
    fields: List[Any] = []
    for name in DEFAULT_ORDER:
        if name == USER_PASSES:
            fields.append((USER_PASSES, List[ExtraPassConfig], field(default_factory=list)))
        else:
            fields.append((name, builtins[name].options_type, field(default_factory=builtins[name].options_type)))
    cls = dataclasses.make_dataclass("PassesConfig", fields)
    cls.__module__ = __name__  # picklable by name (Lightning copies callbacks across processes)
    cls.__doc__ = "Options of every built-in pass, in order; ``extra``: the user's passes, run in place."
    return cls


PassesConfig: Any = _passes_schema()


OnFailure = OnError  # parity.on_failure takes the same values


@dataclass
class ParityConfig:
    enabled: bool = True
    max_batches: int = 8
    data: ParityData = ParityData.auto
    # How to take the model input out of a batch: null = automatic (tensor; first item of a tuple/list;
    # dict key x/input/inputs/image/images), a dict key, an integer index, or "pkg.module:function".
    input: Optional[str] = None
    # Gate: max|fused - ref| / max|ref| over all batches.
    rtol: float = 1e-4
    min_cosine: float = 0.9999
    min_top1_agreement: float = 0.999
    # Allowed accuracy drop (fraction, 0.001 = 0.1 points) when labels are in the batch.
    max_accuracy_drop: float = 0.001
    on_failure: OnFailure = OnFailure["raise"]  # type: ignore[valid-type]


@dataclass
class ExportConfig:
    enabled: bool = True
    # null: <trainer.log_dir>/fx_fused (callback) or ./fx_fused (CLI).
    dir: Optional[str] = None
    formats: List[ExportFormat] = field(
        default_factory=lambda: [ExportFormat.graph_module, ExportFormat.pt2]
    )
    dynamic_batch: bool = True
    overwrite: bool = True
    onnx_opset: Optional[int] = None
    # aoti: one package per batch size listed (compiled for it: faster), or one with a dynamic batch.
    aoti_batch_sizes: List[int] = field(default_factory=list)
    on_format_failure: FormatFailure = FormatFailure["skip"]  # type: ignore[valid-type]
    select: Selection = Selection.preference
    # The batch size the fastest artifact is chosen at (the table shows 1 and this one).
    select_batch_size: int = 1


@dataclass
class FuseConfig:
    # Dotted attribute of the LightningModule to fuse; null: `backbone` if present, else the module.
    target: Optional[str] = None
    weights: WeightsSource = WeightsSource.last
    trace: TraceConfig = field(default_factory=TraceConfig)
    passes: PassesConfig = field(default_factory=PassesConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    on_error: OnError = OnError["raise"]  # type: ignore[valid-type]
    preflight: Preflight = Preflight.full
    # Where fusion, parity and export run: auto (the device training ran on), cpu, or a torch device
    # ("cuda", "cuda:1"). Exported artifacts are built for it (the manifest records each one's device).
    device: str = "auto"


ConfigLike = Union[FuseConfig, DictConfig, Dict[str, Any], None]


# --------------------------------------------------------------------------------------------- loading


def load_config(config: ConfigLike = None, **overrides: Any) -> FuseConfig:
    """Merge ``config`` (dataclass, dict, DictConfig or None) and keyword overrides into the schema.

    Returns a validated :class:`FuseConfig` object. Raises :class:`ConfigError` naming the full key.
    """
    schema = OmegaConf.structured(FuseConfig)
    sources: List[tuple[str, Any]] = []
    if config is not None:
        sources.append(("config", config))
    for key, value in overrides.items():
        if value is not None:
            sources.append((key, {key: value}))
    for label, source in sources:
        plain = _to_plain(source, label)
        _check_keys(plain, FuseConfig, "")
        plain = _normalise(plain)
        try:
            schema = OmegaConf.merge(schema, plain)
        except _MERGE_ERRORS as exc:
            raise _from_omegaconf(exc) from None
    try:
        # OmegaConf.to_object would silently give a '???' (missing) field its dataclass default.
        missing = sorted(OmegaConf.missing_keys(schema))
        if missing:
            raise ConfigError(
                f"{missing[0]}: missing value ('???'); give a value"
                + (" (a registered pass name or 'pkg.module:function')." if missing[0].endswith("].name") else ".")
            )
        cfg = OmegaConf.to_object(schema)
    except _MERGE_ERRORS as exc:
        raise _from_omegaconf(exc) from None
    assert isinstance(cfg, FuseConfig)
    validate(cfg)
    # The user passes: resolved, and their options as their options dataclasses read them.
    extras = [dataclasses.replace(e, options=_typed_pass_options(e, i)) for i, e in enumerate(cfg.passes.extra)]
    return dataclasses.replace(cfg, passes=dataclasses.replace(cfg.passes, extra=extras))


def to_yaml(cfg: FuseConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_container(cfg: FuseConfig) -> Dict[str, Any]:
    """JSON-safe dict view (enums as their values)."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def _to_plain(source: Any, label: str, path: str = "") -> Any:
    """``source`` as plain containers; ``path``: the dotted key ``source`` sits at (for error messages)."""
    if isinstance(source, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(source, resolve=True, enum_to_str=False)
        except OmegaConfBaseException as exc:
            # full_key is relative to this node: prefix the key it sits at, so the message names it.
            raise _from_omegaconf(exc, prefix=path, what="cannot resolve") from None
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        return OmegaConf.to_container(OmegaConf.structured(source), enum_to_str=False)
    if isinstance(source, dict):
        return {k: _to_plain(v, label, _join(path, str(k))) if isinstance(v, (DictConfig, ListConfig)) or (
            dataclasses.is_dataclass(v) and not isinstance(v, type)) else v for k, v in source.items()}
    raise ConfigError(
        f"config: expected a FuseConfig, dict or DictConfig, got {type(source).__name__} ({source!r:.80})"
    )


def _normalise(plain: Any) -> Any:
    """Accept shorthands OmegaConf cannot: ``passes.extra: ["name", ...]`` and ``passes.X: false``."""
    if not isinstance(plain, dict):
        return plain
    passes = plain.get("passes")
    if isinstance(passes, dict):
        passes = dict(passes)
        extra = passes.get("extra")
        if isinstance(extra, (list, tuple)):
            passes["extra"] = [{"name": e} if isinstance(e, str) else e for e in extra]
        for name, value in list(passes.items()):
            if isinstance(value, bool) and name != "extra":
                passes[name] = {"enabled": value}
        plain = {**plain, "passes": passes}
    export = plain.get("export")
    if isinstance(export, dict) and isinstance(export.get("formats"), str):
        plain = {**plain, "export": {**export, "formats": [export["formats"]]}}
    return plain


def _field_types(schema: type) -> Dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _check_keys(value: Any, schema: type, path: str) -> None:
    """Reject unknown keys at every level, with the full path and the closest valid key.

    OmegaConf checks keys too, but loses the path inside lists; this walk keeps it.
    """
    if not isinstance(value, dict):
        return
    fields = _field_types(schema)
    for key, sub in value.items():
        full = f"{path}.{key}" if path else str(key)
        # OmegaConf's merge keeps the default where the value is '???' (missing): say so instead.
        if isinstance(sub, str) and sub == "???" and key in fields:
            raise ConfigError(f"{full}: missing value ('???'); give a value.")
        if key not in fields:
            # passes.<bool> shorthand and enabled flags are handled later; only unknown names fail here.
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" Did you mean '{_join(path, close[0])}'?" if close else ""
            raise ConfigError(
                f"{full}: unknown key.{hint} Allowed keys under '{path or '<root>'}': "
                f"{', '.join(sorted(fields))}."
            )
        ftype = fields[key]
        inner = _unwrap_optional(ftype)
        if dataclasses.is_dataclass(inner):
            if isinstance(sub, dict):
                _check_keys(sub, inner, full)
            elif not (isinstance(sub, bool) and path == "passes") and sub is not None:
                raise ConfigError(
                    f"{full}: expected a mapping of {inner.__name__} options, got {sub!r:.80}."
                )
        elif typing.get_origin(inner) in (list, List):
            (item_type,) = typing.get_args(inner) or (Any,)
            if isinstance(sub, (list, tuple)):
                for i, item in enumerate(sub):
                    if isinstance(item, str) and item == "???":
                        raise ConfigError(f"{full}[{i}]: missing value ('???'); give a value.")
                    if dataclasses.is_dataclass(item_type):
                        if isinstance(item, dict):
                            _check_keys(item, item_type, f"{full}[{i}]")
                            _check_types(item, item_type, f"{full}[{i}]")
                        elif not isinstance(item, str):
                            raise ConfigError(
                                f"{full}[{i}]: expected a name or a mapping with keys "
                                f"{', '.join(f.name for f in dataclasses.fields(item_type))}, got {item!r:.80}."
                            )
                    elif isinstance(item_type, type) and issubclass(item_type, Enum):
                        _check_enum(item, item_type, f"{full}[{i}]")
                    elif item_type in (str, int, float, bool) and isinstance(item, (list, tuple, dict)):
                        raise ConfigError(
                            f"{full}[{i}]: expected a {item_type.__name__}, got {type(item).__name__} {item!r:.80}."
                        )
            elif sub is not None and not (isinstance(sub, str) and full == "export.formats"):
                raise ConfigError(f"{full}: expected a list, got {type(sub).__name__} {sub!r:.80}.")
        elif typing.get_origin(inner) in (dict, Dict):
            # OmegaConf reports a list or scalar here as "Cannot merge DictConfig with ListConfig" at <config>.
            if sub is not None and not isinstance(sub, dict):
                raise ConfigError(f"{full}: expected a mapping, got {type(sub).__name__} {sub!r:.80}.")
        elif isinstance(inner, type) and issubclass(inner, Enum):
            _check_enum(sub, inner, full)
        elif inner is float and isinstance(sub, int) and not isinstance(sub, bool):
            try:
                float(sub)
            except OverflowError:  # OmegaConf raises it raw, without the key
                raise ConfigError(f"{full}: a {sub.bit_length()}-bit integer is too large for a float.") from None


def _check_types(value: Dict[str, Any], schema: type, path: str) -> None:
    """Type-check a list item against its dataclass: OmegaConf's own error there names only the leaf
    ("name: ..."), not the item ("passes.extra[0].name")."""
    try:
        OmegaConf.merge(OmegaConf.structured(schema), value)
    except _MERGE_ERRORS as exc:
        raise _from_omegaconf(exc, prefix=path) from None


def _check_enum(value: Any, enum_type: type, path: str) -> None:
    if isinstance(value, enum_type):
        return
    allowed = [m.name for m in enum_type]  # type: ignore[attr-defined]
    if isinstance(value, str) and value in allowed:
        return
    raise ConfigError(f"{path}: invalid value {value!r}. Allowed: {', '.join(allowed)}.")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# OmegaConf wraps most failures in its own exceptions, but lets some through (OverflowError for a huge int
# in a float field): none of them may escape load_config as anything but a ConfigError.
_MERGE_ERRORS = (OmegaConfBaseException, ValueError, TypeError, OverflowError)


def _from_omegaconf(exc: Exception, prefix: str = "", what: str = "") -> ConfigError:
    if isinstance(exc, ConfigError):
        return exc
    key = getattr(exc, "full_key", None) or ""
    if prefix:
        key = f"{prefix}{key}" if key.startswith("[") else _join(prefix, key) if key else prefix
    key = key or "<config>"
    msg = getattr(exc, "msg", None) or str(exc)
    msg = msg.split("\n")[0]
    if what:
        msg = f"{what}: {msg}"
    value = getattr(exc, "value", None)
    got = f" Got {value!r}." if value is not None and repr(value) not in msg else ""
    return ConfigError(f"{key}: {msg}.{got}".replace("..", "."))


# ------------------------------------------------------------------------------------------ validation

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def validate(cfg: FuseConfig) -> None:
    """Value checks the type system cannot express. Raises ConfigError naming the key; changes nothing."""
    if cfg.target is not None and not _DOTTED.match(cfg.target):
        raise ConfigError(
            f"target: {cfg.target!r} is not a dotted attribute path (e.g. 'backbone' or 'model.encoder'); "
            "use null for the default (backbone if present, else the whole module)."
        )
    _validate_device(cfg.device)
    _validate_parity(cfg.parity)
    _validate_export(cfg.export)
    _validate_trace(cfg.trace)
    for spec in builtin_passes():
        try:
            getattr(cfg.passes, spec.name).check()
        except ValueError as exc:
            raise ConfigError(f"passes.{spec.name}.{exc}") from None


def _validate_device(device: str) -> None:
    if device == "auto":
        return
    import torch

    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"device: {device!r} is not a torch device ({str(exc).splitlines()[0]}); allowed: auto (the device "
            "training ran on), cpu, or a torch device such as cuda or cuda:1."
        ) from None


def _validate_parity(p: ParityConfig) -> None:
    if p.max_batches < 1:
        raise ConfigError(f"parity.max_batches: must be >= 1, got {p.max_batches}.")
    for name in ("rtol", "max_accuracy_drop"):
        value = getattr(p, name)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"parity.{name}: must be a finite number >= 0, got {value}.")
    if not 0.0 <= p.min_top1_agreement <= 1.0:
        raise ConfigError(f"parity.min_top1_agreement: must be in [0, 1], got {p.min_top1_agreement}.")
    if not -1.0 <= p.min_cosine <= 1.0:
        raise ConfigError(f"parity.min_cosine: must be in [-1, 1], got {p.min_cosine}.")
    if p.input is not None and ":" in p.input:
        _import_checked(p.input, "parity.input", callable_required=True)


def _validate_export(e: ExportConfig) -> None:
    if e.enabled and not e.formats:
        raise ConfigError(
            "export.formats: empty while export.enabled is true; allowed: "
            f"{', '.join(f.name for f in ExportFormat)} (or set export.enabled: false)."
        )
    seen = set()
    for i, fmt in enumerate(e.formats):
        if fmt in seen:
            raise ConfigError(f"export.formats[{i}]: {fmt.name!r} is listed twice.")
        seen.add(fmt)
    if any(b < 1 for b in e.aoti_batch_sizes) or len(set(e.aoti_batch_sizes)) != len(e.aoti_batch_sizes):
        raise ConfigError(f"export.aoti_batch_sizes: positive and distinct batch sizes, or [] for one dynamic-batch "
                          f"package; got {list(e.aoti_batch_sizes)}.")
    if e.select_batch_size < 1:
        raise ConfigError(f"export.select_batch_size: must be >= 1, got {e.select_batch_size}.")
    if e.onnx_opset is not None and not 7 <= e.onnx_opset <= 30:
        raise ConfigError(f"export.onnx_opset: must be between 7 and 30 or null, got {e.onnx_opset}.")


def _validate_trace(trace: TraceConfig) -> None:
    import torch

    for i, path in enumerate(trace.leaf_modules):
        obj = _import_checked(path, f"trace.leaf_modules[{i}]")
        if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
            raise ConfigError(f"trace.leaf_modules[{i}]: {path!r} is not a torch.nn.Module subclass.")
    for i, path in enumerate(trace.autowrap_functions):
        _import_checked(path, f"trace.autowrap_functions[{i}]", callable_required=True)
    for i, path in enumerate(trace.autowrap_modules):
        try:
            if not path or path.startswith("."):
                raise ImportError("not an absolute module name")
            importlib.import_module(path)
        except Exception as exc:  # noqa: BLE001 - importing user code may raise anything
            raise ConfigError(
                f"trace.autowrap_modules[{i}]: cannot import module {path!r}: {exception_text(exc)}."
            ) from (None if isinstance(exc, ImportError) else exc)


def _typed_pass_options(extra: ExtraPassConfig, i: int) -> Dict[str, Any]:
    """``passes.extra[i].options`` checked against the pass's options dataclass and converted by it
    (``"false"`` -> False, enums as names); the keys given, no defaults added. Raises ConfigError."""
    if extra.name in ("???", ""):
        raise ConfigError(f"passes.extra[{i}].name: missing; give a registered pass name or 'pkg.module:function'.")
    try:
        spec = resolve_pass(extra.name)
    except (KeyError, ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"passes.extra[{i}].name: {exc.args[0] if exc.args else exc}") from None
    except Exception as exc:  # noqa: BLE001 - importing a user pass may raise anything
        raise ConfigError(f"passes.extra[{i}].name: cannot import {extra.name!r}: {exception_text(exc)}.") from exc
    if spec.stage is not Stage.graph:
        raise ConfigError(
            f"passes.extra[{i}].name: {extra.name!r} works on the module before capture, not on the graph; "
            f"configure it under passes.{extra.name} instead."
        )
    if spec.options_type is None or not extra.options:
        return dict(extra.options)
    option_fields = {f.name for f in dataclasses.fields(spec.options_type)}
    for key in extra.options:
        if key not in option_fields:
            raise ConfigError(
                f"passes.extra[{i}].options.{key}: unknown option of pass {extra.name!r}; "
                f"allowed: {', '.join(sorted(option_fields))}."
            )
    prefix = f"passes.extra[{i}].options"
    _check_keys(extra.options, spec.options_type, prefix)  # enums and huge ints, with the key
    try:
        typed = OmegaConf.merge(OmegaConf.structured(spec.options_type), extra.options)
    except _MERGE_ERRORS as exc:
        raise _from_omegaconf(exc, prefix=prefix) from None
    converted = OmegaConf.to_container(typed, enum_to_str=True)
    assert isinstance(converted, dict)
    return {key: converted[key] for key in extra.options}


def _import_checked(path: str, key: str, callable_required: bool = False) -> Any:
    try:
        obj = import_object(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot import {path!r}: {exc}.") from None
    except Exception as exc:  # noqa: BLE001 - importing user code may raise anything; name the key
        raise ConfigError(f"{key}: cannot import {path!r}: {exception_text(exc)}.") from exc
    if callable_required and not callable(obj):
        raise ConfigError(f"{key}: {path!r} is not callable.")
    return obj


# ---------------------------------------------------------------------------------------------- Hydra


def register_hydra_configs(group: str = "callbacks", name: str = "fx_fuse") -> None:
    """Register the schema in Hydra's ConfigStore.

    Stores ``fx_fuse_schema`` (the bare FuseConfig, for ``defaults:`` schema matching) and
    ``<group>/<name>``: ``{<name>: {_target_: fx_lightning.FXFuseCallback, <default options>}}``. The node
    sits under its own name, like configs/callbacks/fx_fuse.yaml and every entry of a Lightning
    ``callbacks`` group (``cfg.callbacks.<name>._target_``), so Hydra's schema matching of that YAML onto
    this node type-checks it instead of failing with "Key 'fx_fuse' not in 'FuseConfig'".
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="fx_fuse_schema", node=FuseConfig)
    node = OmegaConf.merge({"_target_": "fx_lightning.FXFuseCallback"}, OmegaConf.structured(FuseConfig))
    cs.store(group=group, name=name, node={name: node})
