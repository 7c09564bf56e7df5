"""Fuzzing the configuration surface with hypothesis.

The strategies walk the ``FuseConfig`` dataclass schema (``dataclasses.fields`` + type hints), so a new key
is fuzzed as soon as it exists. Valid configs must load and round-trip through YAML unchanged; a config
with one bad value anywhere (unknown key at any depth, wrong type, bad enum name, out-of-range number,
non-importable import path, list for mapping and vice versa, None where not Optional, OmegaConf's
``???``/``${...}``) must raise ``fx_lightning.ConfigError`` whose message names the full dotted key
(``parity.rtol``, ``passes.extra[0].name``, ``trace.leaf_modules[1]``), and nothing else.

Only validate() narrows a type to a range or a set; those leaves are listed in ``VALID_LEAVES`` /
``BAD_LEAVES`` below (a test checks every listed path still exists in the schema).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Dict, List, Tuple, Union

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from fx_lightning import ConfigError
from fx_lightning.config import ExportFormat, FuseConfig, PreprocessConfig, load_config, to_yaml
from fx_lightning.passes import get_pass, registered_passes

# A load_config call costs ~20 ms (OmegaConf.structured dominates): 80 + 200 + 50 examples keep this
# module around 20-30 s on 2 busy cores.
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------------------ the schema

LIST = "[]"  # a list index in a path pattern
Path = Tuple[Union[str, int], ...]


@dataclass(frozen=True)
class Site:
    """One key of the schema: its path pattern (``LIST`` for any index) and its declared type."""

    pattern: Tuple[str, ...]
    tp: Any

    @property
    def optional(self) -> bool:
        return typing.get_origin(self.tp) is Union and type(None) in typing.get_args(self.tp)

    @property
    def inner(self) -> Any:
        return _unwrap(self.tp)

    @property
    def dotted(self) -> str:
        return render(self.pattern)


def _unwrap(tp: Any) -> Any:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def fields_of(schema: type) -> Dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def walk(schema: type, prefix: Tuple[str, ...] = ()) -> List[Site]:
    """Every key under ``schema``, nested dataclasses and list items included."""
    out: List[Site] = []
    for name, tp in fields_of(schema).items():
        site = Site(prefix + (name,), tp)
        out.append(site)
        inner = site.inner
        if dataclasses.is_dataclass(inner):
            out.extend(walk(inner, site.pattern))
        elif typing.get_origin(inner) is list:
            (item,) = typing.get_args(inner)
            out.append(Site(site.pattern + (LIST,), item))
            if dataclasses.is_dataclass(item):
                out.extend(walk(item, site.pattern + (LIST,)))
    return out


def render(path: typing.Sequence[Union[str, int]]) -> str:
    """("passes", "extra", 0, "name") -> "passes.extra[0].name"."""
    text = ""
    for part in path:
        if isinstance(part, int) or part == LIST:
            text += f"[{part if isinstance(part, int) else ''}]"
        else:
            text += f".{part}" if text else str(part)
    return text


SITES = walk(FuseConfig)
SITE_BY_PATTERN = {s.dotted: s for s in SITES}

# ----------------------------------------------------------------------------------------- valid values

# The built-in passes a user may list under passes.extra: those that work on the graph (not the passes other test
# modules register, which a run importing them first would otherwise draw).
BUILTIN_PASSES = sorted(n for n in registered_passes() if get_pass(n).builtin and get_pass(n).stage.value == "graph")
USER_PASS = "sample_passes:double_output"  # tests/sample_passes.py, importable from the tests directory
IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True)
# Text that YAML and OmegaConf must carry unchanged: any printable Unicode, but not OmegaConf's own
# syntax ("???" = missing, "${...}" = interpolation; both are fuzzed as bad values below), and not the Unicode
# line breaks NEL, LS and PS: PyYAML's emitter writes them raw inside a quoted scalar and its reader folds them to
# a space (a PyYAML limitation that OmegaConf.to_yaml inherits; "\n" itself round-trips).
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x85\u2028\u2029"),
               max_size=12).filter(
    lambda s: "${" not in s and s.strip() != "???"
)
PRIMITIVE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False, allow_infinity=False), TEXT,
)

# The passes that make a lossy variant share the gate's options (passes/lossy.py).
LOSSY_PASSES = ("quantize_int8", "cast_bf16")
# Leaves that validate() narrows beyond their type (dotted pattern -> strategy of valid values).
VALID_LEAVES: Dict[str, st.SearchStrategy] = {
    # null: the default; "": the whole module; else a dotted attribute path.
    "target": st.none() | st.just("") | st.lists(IDENT, min_size=1, max_size=3).map(".".join),
    "parity.max_batches": st.integers(1, 2**62) | st.integers(1, 99).map(str),
    "parity.rtol": st.floats(0, 1e300),
    "parity.max_accuracy_drop": st.floats(0, 1),
    "parity.min_top1_agreement": st.floats(0, 1),
    "parity.min_cosine": st.floats(-1, 1),
    "parity.min_discrete_agreement": st.floats(0, 1),
    "parity.input": st.none() | IDENT | st.integers(0, 9).map(str)
    | st.sampled_from(["builtins:len", "sample_passes:raises"]),
    "export.onnx_opset": st.none() | st.integers(7, 30),
    "device": st.sampled_from(["auto", "cpu", "cuda", "cuda:1", "meta", "mps"]),
    "passes.reparameterize.rtol": st.floats(0, 1e300),
    "passes.batchnorm_forms.rtol": st.floats(0, 1e300),
    "passes.quantize_int8.calibration_batches": st.integers(1, 2**62),
    "passes.quantize_int8.max_float_layers": st.integers(0, 2**62),
    "passes.quantize_int8.ranking_batches": st.integers(1, 2**62),
    **{f"passes.{lossy}.min_top1_agreement": st.floats(0, 1) for lossy in LOSSY_PASSES},
    **{f"passes.{lossy}.max_accuracy_drop": st.floats(0, 1e300) for lossy in LOSSY_PASSES},
    **{f"passes.{lossy}.min_cosine": st.floats(-1, 1) for lossy in LOSSY_PASSES},
    "export.aoti_batch_sizes": st.lists(st.integers(1, 2**31), max_size=4, unique=True),
    "export.select_batch_size": st.integers(1, 2**31),
    # A strategy other than min_latency, and a budget, need select: fastest (and the budget max_throughput):
    # drawn together in tests/test_sweep.py's config test; here the defaults.
    "export.select_strategy": st.just("min_latency"),
    "export.latency_budget_ms": st.none(),
    "export.preprocess.scale": st.floats(1e-30, 1e30),
    # mean and std: both or neither, one value per channel each, std > 0 (drawn together: preprocess_section).
    "export.preprocess.mean": st.none(),
    "export.preprocess.std": st.none(),
    # "module" is required in an item (its default is '???'); the others are optional.
    "passes.batchnorm_forms.modules[]": st.fixed_dictionaries(
        {"module": st.sampled_from(["torch.nn:ReLU", "torch.nn.modules.batchnorm:BatchNorm2d",
                                    "timm.layers.norm_act.BatchNormAct2d", "my_pkg.layers.*Norm"])},
        optional={"epilogue": st.lists(IDENT, max_size=2), "eps": st.none() | st.floats(1e-12, 1.0)}),
    # Non-empty and unique (export.enabled may be true); a single name is accepted as a one-item list.
    "export.formats": st.lists(st.sampled_from(list(ExportFormat)), min_size=1, unique=True)
    | st.sampled_from([f.name for f in ExportFormat]),
    "trace.leaf_modules[]": st.sampled_from(
        ["torch.nn.Conv2d", "torch.nn:ReLU", "torchvision.ops.misc:FrozenBatchNorm2d", "torch.nn.modules.batchnorm._BatchNorm"]
    ),
    "trace.autowrap_functions[]": st.sampled_from(["math:sqrt", "torch.nn.functional.relu", "builtins:len", "operator:add"]),
    "trace.autowrap_modules[]": st.sampled_from(["math", "torch", "operator", "torch.nn.functional"]),
    # export.mlflow: names MLflow accepts; alias and registry_uri need register_as, enabled: true needs an export.
    "export.mlflow.enabled": st.none() | st.just(False),
    "export.mlflow.artifact_path": st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
    "export.mlflow.format": st.none() | st.sampled_from([f.name for f in ExportFormat] + ["openvino-int8", "pt2-bf16"]),
    "export.mlflow.register_as": st.none() | st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_ .-]{0,20}", fullmatch=True)
    .filter(lambda s: ".." not in s and not s.endswith((".", " "))),
    "export.mlflow.alias": st.none(),
    "export.mlflow.registry_uri": st.none(),
}

# Spellings OmegaConf's BooleanNode accepts besides True/False.
BOOL_WORDS = ["true", "false", "yes", "no", "on", "off", "True", "FALSE", "1", "0"]


def valid_value(site: Site, path: Path) -> st.SearchStrategy:
    """A valid value for ``site`` (its path ``path`` has concrete list indices)."""
    if site.dotted in VALID_LEAVES:
        return VALID_LEAVES[site.dotted]
    if site.dotted == "export.preprocess":
        return preprocess_section()
    if site.dotted == "passes.extra[]":
        return extra_entry()
    strategy = valid_for_type(site.inner, site.pattern)
    if site.optional:
        strategy = st.none() | strategy
    if len(site.pattern) == 2 and site.pattern[0] == "passes" and dataclasses.is_dataclass(site.inner):
        strategy = strategy | st.booleans()  # passes.<name>: false is short for {enabled: false}
    return strategy


def valid_for_type(tp: Any, pattern: Tuple[str, ...]) -> st.SearchStrategy:
    tp = _unwrap(tp)
    if tp is bool:
        return st.booleans() | st.sampled_from(BOOL_WORDS)
    if tp is int:
        return st.integers(-(2**62), 2**62)
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(10**6), 10**6)
    if tp is str:
        return TEXT
    if isinstance(tp, type) and issubclass(tp, Enum):
        return st.sampled_from(list(tp)) | st.sampled_from([m.name for m in tp])
    if dataclasses.is_dataclass(tp):
        return valid_dataclass(tp, pattern)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        item_site = SITE_BY_PATTERN[render(pattern + (LIST,))]
        return st.lists(valid_value(item_site, ()), max_size=3)
    if origin is dict:
        return st.dictionaries(IDENT, PRIMITIVE, max_size=3)
    if tp is Any:
        return PRIMITIVE
    raise NotImplementedError(f"no strategy for {render(pattern)}: {tp!r}; teach the fuzzer this type")


def valid_dataclass(schema: type, pattern: Tuple[str, ...]) -> st.SearchStrategy:
    """A mapping with any subset of ``schema``'s keys, each valid."""
    optional = {}
    for name in fields_of(schema):
        site = SITE_BY_PATTERN.get(render(pattern + (name,)))
        optional[name] = valid_value(site, ()) if site else valid_for_type(fields_of(schema)[name], pattern + (name,))
    return st.fixed_dictionaries({}, optional=optional)


@st.composite
def extra_entry(draw: st.DrawFn) -> Any:
    """passes.extra[i]: a registered name or an import path, bare or as a mapping with valid options."""
    name = draw(st.sampled_from(BUILTIN_PASSES + [USER_PASS]))
    if draw(st.booleans()):
        return name
    entry: Dict[str, Any] = {"name": name}
    if draw(st.booleans()):
        entry["enabled"] = draw(st.booleans())
    if draw(st.booleans()):
        options_type = get_pass(name).options_type if name in BUILTIN_PASSES else None
        if options_type is not None:
            entry["options"] = draw(options_dict(options_type))
        else:
            entry["options"] = draw(st.dictionaries(IDENT, PRIMITIVE, max_size=3))
    return entry


def options_dict(options_type: type) -> st.SearchStrategy:
    """Valid options of a registered pass, from its own options dataclass."""
    return st.fixed_dictionaries(
        {}, optional={name: valid_for_type(tp, ()) for name, tp in fields_of(options_type).items()}
    )


@st.composite
def preprocess_section(draw: st.DrawFn) -> Dict[str, Any]:
    """export.preprocess: any valid subset of its keys, with mean and std given together (same length) or not."""
    section = draw(valid_dataclass(PreprocessConfig, ("export", "preprocess")))
    if draw(st.booleans()):
        channels = draw(st.integers(1, 4))
        section["mean"] = draw(st.lists(st.floats(-1e6, 1e6), min_size=channels, max_size=channels))
        section["std"] = draw(st.lists(st.floats(1e-6, 1e6), min_size=channels, max_size=channels))
    return section


VALID_CONFIG = valid_dataclass(FuseConfig, ())

# ------------------------------------------------------------------------------------------- bad values

NO_MODULE = "fxl_fuzz_no_such_module"
BAD_IMPORT_PATHS = [
    f"{NO_MODULE}.Thing", f"{NO_MODULE}:Thing", ".relative.Thing", "..x:y", "math:no_such_name", "math:",
    ":sqrt", "", "math..sqrt", "torch.nn.Conv2d.", "1abc.def",
]
# Leaves where a value of the right type is still wrong (dotted pattern -> strategy of bad values).
BAD_LEAVES: Dict[str, st.SearchStrategy] = {
    "target": st.sampled_from(["a/b", "1abc", "a..b", ".a", "a.", "a b", "a-b"]),
    "parity.max_batches": st.integers(-(2**62), 0),
    "parity.rtol": st.floats(max_value=-1e-300) | st.sampled_from([math.inf, math.nan]),
    "parity.max_accuracy_drop": st.floats(max_value=-1e-300) | st.sampled_from([math.inf, -math.inf, math.nan]),
    "parity.min_top1_agreement": st.floats(min_value=1.0, exclude_min=True) | st.floats(max_value=0.0, exclude_max=True)
    | st.just(math.nan),
    "parity.min_cosine": st.floats(min_value=1.0, exclude_min=True) | st.floats(max_value=-1.0, exclude_max=True)
    | st.just(math.nan),
    "parity.min_discrete_agreement": st.floats(min_value=1.0, exclude_min=True)
    | st.floats(max_value=0.0, exclude_max=True) | st.just(math.nan),
    "parity.input": st.sampled_from([p for p in BAD_IMPORT_PATHS if ":" in p] + ["math:pi", "sample_passes:NOT_CALLABLE"]),
    "export.onnx_opset": st.integers(-(2**40), 6) | st.integers(31, 2**40),
    "passes.batchnorm_forms.rtol": st.floats(max_value=-1e-300) | st.sampled_from([math.inf, math.nan]),
    "passes.quantize_int8.calibration_batches": st.integers(-(2**62), 0),
    "passes.quantize_int8.max_float_layers": st.integers(-(2**62), -1),
    "passes.quantize_int8.ranking_batches": st.integers(-(2**62), 0),
    **{f"passes.{lossy}.min_top1_agreement": st.floats(min_value=1.0, exclude_min=True)
       | st.floats(max_value=0.0, exclude_max=True) | st.just(math.nan) for lossy in LOSSY_PASSES},
    **{f"passes.{lossy}.max_accuracy_drop": st.floats(max_value=-1e-300) | st.sampled_from([math.inf, math.nan])
       for lossy in LOSSY_PASSES},
    **{f"passes.{lossy}.min_cosine": st.floats(min_value=1.0, exclude_min=True)
       | st.floats(max_value=-1.0, exclude_max=True) | st.just(math.nan) for lossy in LOSSY_PASSES},
    "export.aoti_batch_sizes": st.lists(st.integers(-(2**31), 0), min_size=1, max_size=3)
    | st.integers(1, 64).map(lambda b: [b, b]),
    "export.select_batch_size": st.integers(-(2**31), 0),
    "export.latency_budget_ms": st.floats(max_value=0.0) | st.sampled_from([math.inf, math.nan]),
    "export.preprocess.scale": st.floats(max_value=0.0) | st.sampled_from([math.inf, math.nan]),
    # A std that is not > 0 (with its mean), or mean and std of different lengths: the error names std.
    "export.preprocess.std": st.lists(st.floats(max_value=0.0), min_size=1, max_size=4)
    | st.integers(5, 8).map(lambda n: [1.0] * n),  # valid sections have 1 to 4 channels
    "trace.leaf_modules[]": st.sampled_from(BAD_IMPORT_PATHS + ["builtins:len", "math:pi", "torch.nn.functional:relu"]),
    "trace.autowrap_functions[]": st.sampled_from(BAD_IMPORT_PATHS + ["math:pi", "sample_passes:NOT_CALLABLE"]),
    "trace.autowrap_modules[]": st.sampled_from([NO_MODULE, ".relative", "..x", "", "math.", "1abc", "math:sqrt"]),
    "export.mlflow.artifact_path": st.sampled_from(["", "a.b", "a/b", "x:y", "50%"]),
    "export.mlflow.format": st.sampled_from(["tflite", "onnx-int4", "ONNX", ""]),
    "export.mlflow.register_as": st.sampled_from(["a/b", "a:b", "..x", ".", "", " "]),
    "export.mlflow.alias": st.sampled_from(["latest", "v3", "a b", "x/y"]),
    "passes.extra[].name": st.sampled_from(
        ["no_such_pass", "fuse_conv_bnn", "", "???"] + BAD_IMPORT_PATHS[:8] + ["sample_passes:NOT_CALLABLE"]
    ),
}


def bad_for_type(site: Site) -> st.SearchStrategy:
    """Values of the wrong shape or type for ``site`` (what OmegaConf would reject or mangle)."""
    tp = site.inner
    not_none = [] if site.optional else [None]
    if tp is bool:
        return st.sampled_from(["maybe", "", "tru", 1.5, [True], {"a": True}] + not_none)
    if tp is int:
        return st.sampled_from(["three", "2.5", 2.5, True, [1], {"a": 1}] + not_none)
    if tp is float:
        return st.sampled_from(["small", "1e-3x", True, [0.1], {"a": 0.1}, 10**400, -(10**400)] + not_none)
    if tp is str:
        return st.sampled_from([["a"], {"a": "b"}] + not_none)
    if isinstance(tp, type) and issubclass(tp, Enum):
        names = {m.name for m in tp}
        return (st.text(max_size=8).filter(lambda s: s not in names) | st.sampled_from([0, 1.5, True, ["x"], {"a": 1}] + not_none))
    if dataclasses.is_dataclass(tp):
        bool_ok = len(site.pattern) == 2 and site.pattern[0] == "passes"  # passes.X: false
        str_ok = site.pattern[-1] == LIST  # passes.extra: ["name"]
        return st.sampled_from(
            ([] if str_ok else ["yes"]) + [3, 1.5, ["enabled"]] + ([] if bool_ok else [True]) + not_none
        )
    origin = typing.get_origin(tp)
    if origin is list:
        scalars: List[Any] = [3, {"a": 1}, True] + not_none
        if site.dotted != "export.formats":  # a single format name is an accepted shorthand
            scalars.append("torch.nn.Conv2d")
        return st.sampled_from(scalars)
    if origin is dict:
        return st.sampled_from([[1, 2], "x", 3, True] + not_none)
    if tp is Any:
        return st.nothing()
    raise NotImplementedError(f"no bad values for {site.dotted}: {site.tp!r}")


# OmegaConf syntax that is wrong wherever a value goes: a missing value and a dangling interpolation.
OMEGACONF_BAD = st.sampled_from(["???", "${fxl_fuzz_nowhere}", "${parity.nowhere}"])


@dataclass
class Case:
    config: Dict[str, Any]
    key: str  # the dotted key the error must name
    what: str

    def __repr__(self) -> str:
        return f"Case(key={self.key!r}, what={self.what!r}, config={self.config!r})"


def _container(config: Dict[str, Any], path: Path) -> Any:
    """The dict/list that holds ``path[-1]``, created (with valid fillers) as needed."""
    node: Any = config
    for part in path[:-1]:
        if isinstance(node, dict):
            if not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]
        else:
            node = node[part]
    return node


def _set(config: Dict[str, Any], path: Path, value: Any) -> None:
    parent = _container(config, path)
    parent[path[-1]] = value


@st.composite
def concrete_path(draw: st.DrawFn, site: Site, config: Dict[str, Any]) -> Path:
    """Instantiate ``site.pattern`` in ``config``: create the containers on the way and pick list indices,
    growing lists with valid items; everything added is valid, so the mutation is the only error."""
    path: List[Union[str, int]] = []
    node: Any = config
    for i, part in enumerate(site.pattern):
        last = i + 1 == len(site.pattern)
        if part == LIST:
            assert isinstance(node, list)
            item_site = SITE_BY_PATTERN[render(site.pattern[: i + 1])]
            index = draw(st.integers(0, len(node)))
            if index == len(node):
                if item_site.dotted == "export.formats[]":  # formats must stay unique
                    unused = [f for f in ExportFormat if f not in node and f.name not in node]
                    if not unused:
                        index = 0
                    else:
                        node.append(draw(st.sampled_from(unused)))
                else:
                    node.append(draw(valid_value(item_site, ())))
            if not last and isinstance(node[index], str):  # passes.extra: "name" -> {"name": "name"}
                node[index] = {"name": node[index]}
            path.append(index)
            node = node[index]
        else:
            if not last:
                want = list if site.pattern[i + 1] == LIST else dict
                child = node.get(part)
                if not isinstance(child, want):
                    # A single format name is shorthand for a list: keep it as that list.
                    child = [child] if want is list and isinstance(child, str) else want()
                    node[part] = child
                node = child
            path.append(part)
    return tuple(path)


@st.composite
def invalid_case(draw: st.DrawFn) -> Case:
    """A valid config with exactly one bad value, and the dotted key the error must name."""
    config = draw(VALID_CONFIG)
    site = draw(st.sampled_from(SITES))
    path = draw(concrete_path(site, config))
    key = render(path)
    kind = draw(st.sampled_from(["type", "domain", "unknown_key", "omegaconf"]))
    if kind == "unknown_key" and dataclasses.is_dataclass(site.inner):
        parent = _container(config, path + ("x",))
        if not isinstance(parent, dict):  # e.g. passes.fuse_conv_bn: false
            _set(config, path, {})
            parent = _container(config, path + ("x",))
        bad_key = draw(IDENT.filter(lambda k: k not in fields_of(site.inner)))
        parent[bad_key] = draw(PRIMITIVE)
        return Case(config, f"{key}.{bad_key}", "unknown key")
    if kind == "domain" and site.dotted == "export.formats":
        config.setdefault("export", {})["enabled"] = True
        if draw(st.booleans()):
            _set(config, path, [])
            return Case(config, key, "no formats while export is enabled")
        names = draw(st.lists(st.sampled_from([f.name for f in ExportFormat]), min_size=1, unique=True))
        dup = draw(st.integers(0, len(names) - 1))
        _set(config, path, names + [names[dup]])
        return Case(config, f"{key}[{len(names)}]", "a format listed twice")
    if kind == "domain" and site.dotted in BAD_LEAVES:
        value = draw(BAD_LEAVES[site.dotted])
        _set(config, path, value)
        return Case(config, key, f"bad value {value!r}")
    if kind == "omegaconf" and not dataclasses.is_dataclass(site.inner) and typing.get_origin(site.inner) is not list:
        value = draw(OMEGACONF_BAD)
        _set(config, path, value)
        return Case(config, key, f"OmegaConf syntax {value!r}")
    value = draw(bad_for_type(site))
    _set(config, path, value)
    return Case(config, key, f"wrong type {value!r}")


# ------------------------------------------------------------------------------- options of extra passes


@st.composite
def invalid_extra_options(draw: st.DrawFn) -> Case:
    """A registered pass named in passes.extra with a bad option name or value."""
    config = draw(VALID_CONFIG)
    extra = draw(st.lists(extra_entry(), max_size=2))
    name = draw(st.sampled_from(BUILTIN_PASSES))
    options_type = get_pass(name).options_type
    options = draw(options_dict(options_type))
    index = len(extra)
    fields = fields_of(options_type)
    if draw(st.booleans()):
        bad = draw(IDENT.filter(lambda k: k not in fields))
        options[bad] = draw(PRIMITIVE)
        key = f"passes.extra[{index}].options.{bad}"
    else:
        field_name = draw(st.sampled_from(sorted(fields)))
        options[field_name] = draw(bad_for_type(Site(("options", field_name), fields[field_name])))
        key = f"passes.extra[{index}].options.{field_name}"
    extra.append({"name": name, "options": options})
    config.setdefault("passes", {})
    if not isinstance(config["passes"], dict):
        config["passes"] = {}
    config["passes"]["extra"] = extra
    return Case(config, key, "bad pass option")


# ------------------------------------------------------------------------------------------------ tests


def _load(config: Dict[str, Any], route: str) -> Any:
    """load_config through one of its entry forms: dict, DictConfig, keyword overrides, or the dataclass
    a first load made (what FXFuseCallback passes on)."""
    if route == "dict":
        return load_config(config)
    if route == "dictconfig":
        return load_config(OmegaConf.create(config))
    if route == "dataclass":
        cfg = load_config(config)
        again = load_config(cfg)
        assert again == cfg
        return again
    return load_config(**config)


def _normalised(value: Any) -> Any:
    """What a valid input value becomes in the loaded config (enum names, shorthands expanded)."""
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, dict):
        return {k: _normalised(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalised(v) for v in value]
    return value


def _expected_leaves(given_: Any, loaded: Any, path: str) -> List[Tuple[str, Any, Any]]:
    """(key, given, loaded) for every leaf of the input, to check nothing was dropped or changed."""
    if isinstance(given_, bool) and isinstance(loaded, dict):  # passes.X: false -> {enabled: false}
        return [(f"{path}.enabled", given_, loaded["enabled"])]
    if isinstance(given_, str) and isinstance(loaded, dict):  # passes.extra: ["name"] -> [{name: ...}]
        return [(f"{path}.name", given_, loaded["name"])]
    if isinstance(given_, str) and isinstance(loaded, list):  # export.formats: "pt2" -> ["pt2"]
        return [(path, [given_], loaded)]
    if isinstance(given_, dict):
        assert isinstance(loaded, dict), path
        out: List[Tuple[str, Any, Any]] = []
        for k, v in given_.items():
            out.extend(_expected_leaves(v, loaded[k], f"{path}.{k}" if path else k))
        return out
    if isinstance(given_, (list, tuple)):
        assert isinstance(loaded, list) and len(loaded) == len(given_), path
        return [leaf for i, (g, lo) in enumerate(zip(given_, loaded)) for leaf in _expected_leaves(g, lo, f"{path}[{i}]")]
    return [(path, given_, loaded)]


def _same(given_: Any, loaded: Any) -> bool:
    """Whether ``loaded`` is what OmegaConf's documented conversions make of ``given_``."""
    if isinstance(given_, Enum):
        return loaded == given_.name
    if isinstance(given_, list):
        return [_normalised(g) for g in given_] == loaded
    if isinstance(loaded, bool) and isinstance(given_, str):
        return loaded == (given_.lower() in ("true", "yes", "on", "1"))
    if isinstance(loaded, (int, float)) and not isinstance(loaded, bool) and isinstance(given_, str):
        return loaded == type(loaded)(given_)
    if isinstance(loaded, float) and type(given_) is int:
        return loaded == float(given_)
    return type(given_) is type(loaded) and given_ == loaded


@settings(FUZZ, max_examples=80)
@given(config=VALID_CONFIG, route=st.sampled_from(["dict", "dictconfig", "kwargs", "dataclass"]))
def test_valid_configs_load_keep_every_value_and_round_trip_through_yaml(config: Dict[str, Any], route: str) -> None:
    cfg = _load(config, route)
    assert isinstance(cfg, FuseConfig)
    # Every value given is in the result (nothing silently dropped or replaced by a default).
    node = OmegaConf.structured(cfg)
    loaded = OmegaConf.to_container(node, enum_to_str=True)
    for key, given_, got in _expected_leaves(config, loaded, ""):
        assert _same(given_, got), f"{key}: gave {given_!r}, loaded {got!r}"
    # YAML round trip: OmegaConf's own view of the dataclass is what to_yaml writes, and reads back equal.
    text = OmegaConf.to_yaml(node)
    assert to_yaml(cfg) == text
    again = load_config(OmegaConf.create(text))
    assert again == cfg, f"round trip changed the config:\n{text}"


def _check_error(case: Case, route: str) -> None:
    try:
        _load(case.config, route)
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith(f"{case.key}:"), f"the message does not start with {case.key!r}: {message}"
    else:
        pytest.fail(f"{case!r} was accepted (route {route})")


def _found(config: Dict[str, Any], key: str, route: str = "dict") -> Callable[[Any], Any]:
    return example(case=Case(config, key, "found by the fuzzer"), route=route)


# What the fuzzer found (each raised a raw exception, lost the key, or was accepted); kept as examples.
@_found({"trace": {"leaf_modules": [".relative.Thing"]}}, "trace.leaf_modules[0]")  # TypeError
@_found({"trace": {"autowrap_modules": [""]}}, "trace.autowrap_modules[0]")  # ValueError
@_found({"parity": {"input": "..x:y"}}, "parity.input")  # TypeError
@_found({"passes": {"extra": [{"name": ".x:y"}]}}, "passes.extra[0].name")  # TypeError
@_found({"passes": {"extra": [{"name": ["a"]}]}}, "passes.extra[0].name")  # message said "name:"
@_found({"passes": {"extra": [{"name": "fuse_conv_bn", "enabled": "maybe"}]}}, "passes.extra[0].enabled")
@_found({"passes": {"extra": [{"name": "fuse_conv_bn", "options": None}]}}, "passes.extra[0].options")
@_found({"target": "???"}, "target")  # silently the default
@_found({"parity": {"rtol": "???"}}, "parity.rtol")  # silently the default
@_found({"parity": {"rtol": 10**400}}, "parity.rtol")  # OverflowError from OmegaConf, no key
@_found({"export": {"preprocess": {"mean": [10**400]}}}, "export.preprocess.mean[0]")  # the same, in a list
@_found({"target": "${fxl_fuzz_nowhere}"}, "target", route="dictconfig")  # "config: cannot resolve"
@_found({"trace": {"mode": "${fxl_fuzz_nowhere}"}}, "trace.mode", route="kwargs")  # "trace.trace: ..."
@FUZZ
@given(case=invalid_case(), route=st.sampled_from(["dict", "dictconfig", "kwargs"]))
def test_invalid_configs_raise_config_error_naming_the_key(case: Case, route: str) -> None:
    if route == "kwargs" and "." not in case.key and "[" not in case.key and case.config.get(case.key) is None:
        route = "dict"  # load_config(trace=None) means "not given", not "trace: null"
    if route == "dictconfig":
        try:
            OmegaConf.create(case.config)
        except Exception:  # noqa: BLE001 - values OmegaConf cannot hold at all: not our surface
            route = "dict"
    _check_error(case, route)


@example(case=Case({"passes": {"extra": [{"name": "fuse_conv_bn", "options": {"fold_dtype": "float16"}}]}},
                   "passes.extra[0].options.fold_dtype", "found by the fuzzer: accepted, failed after training"))
@settings(FUZZ, max_examples=50)
@given(case=invalid_extra_options())
def test_bad_options_of_an_extra_pass_raise_config_error_naming_the_key(case: Case) -> None:
    _check_error(case, "dict")


def test_options_of_an_extra_pass_are_typed() -> None:
    """Options of a registered pass come out as its options dataclass types: "false" must not reach the
    pass as a (truthy) string."""
    cfg = load_config(
        {"passes": {"extra": [{"name": "fuse_conv_bn", "options": {"copy_shared_modules": "false", "fold_dtype": "float32"}}]}}
    )
    assert cfg.passes.extra[0].options == {"copy_shared_modules": False, "fold_dtype": "float32"}


@pytest.mark.parametrize(
    "config, key",
    [
        ({"trace": {"leaf_modules": ["fxl_fuzz_broken:Thing"]}}, "trace.leaf_modules[0]"),
        ({"trace": {"autowrap_functions": ["fxl_fuzz_broken:fn"]}}, "trace.autowrap_functions[0]"),
        ({"trace": {"autowrap_modules": ["fxl_fuzz_broken"]}}, "trace.autowrap_modules[0]"),
        ({"parity": {"input": "fxl_fuzz_broken:fn"}}, "parity.input"),
        ({"passes": {"extra": ["fxl_fuzz_broken:fn"]}}, "passes.extra[0].name"),
    ],
)
def test_user_module_that_fails_to_import_is_a_config_error(
    config: Dict[str, Any], key: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing user code may raise anything (here a RuntimeError): still a ConfigError naming the key."""
    (tmp_path / "fxl_fuzz_broken.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fxl_fuzz_broken", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith(f"{key}:") and "broken at import" in str(info.value)


def test_every_listed_leaf_exists_in_the_schema() -> None:
    """VALID_LEAVES/BAD_LEAVES name real keys (a renamed key must not silently lose its constraint)."""
    for pattern in list(VALID_LEAVES) + list(BAD_LEAVES):
        assert pattern in SITE_BY_PATTERN, pattern
    # And every leaf type has a strategy (a new key of a new type fails here, not silently).
    for site in SITES:
        valid_for_type(site.inner, site.pattern)
        bad_for_type(site)


def test_on_error_enum_round_trips() -> None:
    """OnError is a functional Enum whose member ``raise`` is a keyword: by name, by instance, via YAML."""
    from fx_lightning.config import OnError

    for name in ("raise", "warn"):
        cfg = load_config({"on_error": name, "parity": {"on_failure": OnError[name]}})
        assert cfg.on_error is OnError[name] and cfg.parity.on_failure is OnError[name]
        text = to_yaml(cfg)
        assert f"on_error: {name}" in text
        assert load_config(OmegaConf.create(text)) == cfg
