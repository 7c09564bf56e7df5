"""Configuring FXFuseCallback: bad configurations fail at construction naming the key (directly, through
hydra.utils.instantiate and through a LightningCLI YAML); good ones, the shipped YAML and presets work."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List
from unittest import mock

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import lightning_helpers as H
from fx_lightning import ConfigError, FXFuseCallback
from fx_lightning.config import (
    ExportConfig,
    FuseConfig,
    OnError,
    TraceConfig,
    WeightsSource,
    load_config,
    register_hydra_configs,
    to_container,
)

CONFIGS = H.REPO / "configs"

# (kwargs, the key the message must name, another fragment it must contain: value or what is allowed)
BAD: List[Any] = [
    ({"weights": "bset"}, "weights", "Allowed: last, best"),
    ({"weights": 3}, "weights", "Allowed: last, best"),
    ({"on_error": "ignore"}, "on_error", "Allowed: raise, warn"),
    ({"target": "backbone/conv"}, "target", "'backbone/conv'"),
    ({"trace": {"mode": "jit"}}, "trace.mode", "Allowed: auto, fx, export"),
    ({"trace": {"mdoe": "fx"}}, "trace.mdoe", "Did you mean 'trace.mode'"),
    ({"trace": {"leaf_modules": ["nope_pkg.Block"]}}, "trace.leaf_modules[0]", "nope_pkg"),
    ({"trace": {"leaf_modules": "torch.nn.Conv2d"}}, "trace.leaf_modules", "expected a list"),
    ({"trace": {"autowrap_functions": ["math:no_such_function"]}}, "trace.autowrap_functions[0]", "no_such_function"),
    ({"export": {"dynamic_batch": "maybe"}}, "export.dynamic_batch", "'maybe'"),
    ({"trace": {"concrete_args": [1]}}, "trace.concrete_args", "expected a mapping"),
    ({"passes": {"fuse_conv_bnn": {}}}, "passes.fuse_conv_bnn", "Did you mean 'passes.fuse_conv_bn'"),
    ({"passes": {"fuse_conv_bn": {"enabeld": False}}}, "passes.fuse_conv_bn.enabeld", "enabled"),
    ({"passes": {"fuse_conv_bn": {"fold_dtype": "float16"}}}, "passes.fuse_conv_bn.fold_dtype", "float64, float32"),
    ({"passes": {"remove_dropout": "yes"}}, "passes.remove_dropout", "'yes'"),
    ({"passes": {"extra": ["no_such_pass"]}}, "passes.extra[0].name", "unknown pass 'no_such_pass'"),
    ({"passes": {"extra": [5]}}, "passes.extra[0]", "expected a name or a mapping with keys name, enabled, options"),
    ({"passes": {"extra": ["fuse_conv_bn", {"nmae": "x"}]}}, "passes.extra[1].nmae", "Did you mean"),
    ({"passes": {"extra": ["no_such_module_xyz:fn"]}}, "passes.extra[0].name", "no_such_module_xyz"),
    ({"passes": {"extra": [{"name": "fuse_conv_bn", "options": {"bogus": 1}}]}},
     "passes.extra[0].options.bogus", "fold_dtype"),
    ({"passes": {"extra": [{"name": "fuse_conv_bn", "options": "x"}]}}, "passes.extra[0].options", "mapping"),
    ({"parity": {"rtol": -1e-4}}, "parity.rtol", ">= 0"),
    ({"parity": {"rtol": "small"}}, "parity.rtol", "'small'"),
    ({"parity": {"rtol": "small"}}, "parity.rtol", "Allowed: a number"),
    ({"parity": {"rtol": 10 ** 400}}, "parity.rtol", "Allowed: a number"),
    ({"parity": {"enabled": "maybe"}}, "parity.enabled", "Allowed: true or false"),
    ({"parity": {"rtl": 1e-3}}, "parity.rtl", "Did you mean 'parity.rtol'"),
    ({"parity": {"max_batches": 0}}, "parity.max_batches", ">= 1"),
    ({"parity": {"max_batches": 2.5}}, "parity.max_batches", "2.5"),
    ({"parity": {"min_top1_agreement": 1.5}}, "parity.min_top1_agreement", "[0, 1]"),
    ({"parity": {"min_cosine": 2}}, "parity.min_cosine", "[-1, 1]"),
    ({"parity": {"max_accuracy_drop": float("nan")}}, "parity.max_accuracy_drop", "nan"),
    ({"parity": {"on_failure": "ignore"}}, "parity.on_failure", "Allowed: raise, warn"),
    ({"parity": {"data": "test"}}, "parity.data", "Allowed: auto, val, train, example"),
    ({"parity": {"input": "no_module_xyz:fn"}}, "parity.input", "no_module_xyz"),
    ({"parity": "strict"}, "parity", "'strict'"),
    ({"export": {"formats": ["zip"]}}, "export.formats[0]", "pt2, graph_module, code, onnx"),
    ({"export": {"formats": []}}, "export.formats", "allowed: pt2, graph_module, code, onnx"),
    ({"export": {"formats": ["pt2", "pt2"]}}, "export.formats[1]", "twice"),
    ({"export": {"onnx_opset": 3}}, "export.onnx_opset", "got 3"),
    ({"export": {"dirr": "out"}}, "export.dirr", "Did you mean 'export.dir'"),
    ({"export": "yes"}, "export", "'yes'"),
    ({"trace": {"dynamic_batch": False}}, "trace.dynamic_batch",
     "moved to export.dynamic_batch (one knob for the capture and the artifacts)"),
]
IDS = [key for _, key, _ in BAD]


def _check(message: str, key: str, fragment: str) -> None:
    assert f"{key}:" in message, message
    assert fragment in message, message


@pytest.mark.parametrize("kwargs, key, fragment", BAD, ids=IDS)
def test_bad_config_rejected_at_construction(kwargs: Dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        FXFuseCallback(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{key}:"), message
    _check(message, key, fragment)


def test_a_missing_pass_name_says_what_a_name_is() -> None:
    """(Hydra's instantiate refuses the '???' itself, before the callback sees it.)"""
    with pytest.raises(ConfigError, match=r"^passes\.extra\[0\]\.name: missing value .*a registered pass name or "
                                          r"'pkg\.module:function'"):
        FXFuseCallback(passes={"extra": [{"name": "???"}]})


@pytest.mark.parametrize("kwargs, key, fragment", BAD, ids=IDS)
def test_bad_config_rejected_through_hydra_instantiate(kwargs: Dict[str, Any], key: str, fragment: str) -> None:
    node = OmegaConf.create({"_target_": "fx_lightning.FXFuseCallback", **kwargs})
    with pytest.raises(Exception) as info:
        instantiate(node)
    chain = _exception_chain(info.value)
    assert any(isinstance(e, ConfigError) for e in chain), chain
    _check(str(info.value), key, fragment)


@contextlib.contextmanager
def _cli_yaml(tmp_path: Path, init_args: Dict[str, Any]) -> Iterator[List[str]]:
    config = {
        "trainer": {
            "logger": False,
            "default_root_dir": str(tmp_path),
            "callbacks": [{"class_path": "fx_lightning.FXFuseCallback", "init_args": init_args}],
        }
    }
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(config))
    yield ["--config", str(path)]


def _cli(args: List[str]) -> Any:
    from lightning.pytorch.cli import LightningCLI

    from examples.data import StripesDataModule
    from examples.models import StripesClassifier

    with mock.patch.object(sys, "argv", ["cli"]):  # pytest's own argv is not the CLI's
        return LightningCLI(StripesClassifier, StripesDataModule, args=args, run=False,
                            parser_kwargs={"exit_on_error": False}, save_config_callback=None)


# The CLI is slower to build: a spread of the cases above (every level, enums, lists, values) is enough.
CLI_CASES = [BAD[i] for i in (0, 2, 5, 6, 11, 13, 15, 16, 20, 22, 27, 28, 32, 36, -1)]


@pytest.mark.parametrize("kwargs, key, fragment", CLI_CASES, ids=[c[1] for c in CLI_CASES])
def test_bad_config_rejected_through_lightning_cli_yaml(
    tmp_path: Path, kwargs: Dict[str, Any], key: str, fragment: str
) -> None:
    with _cli_yaml(tmp_path, kwargs) as args, pytest.raises(Exception) as info:
        _cli(args)
    # jsonargparse re-raises the ConfigError (a ValueError) inside its own union error; the text survives.
    _check(str(info.value), key, fragment)


def test_top_level_typo_is_rejected_everywhere(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="weigths"):
        FXFuseCallback(weigths="best")  # type: ignore[call-arg]
    with pytest.raises(Exception, match="weigths"):
        instantiate({"_target_": "fx_lightning.FXFuseCallback", "weigths": "best"})
    with _cli_yaml(tmp_path, {"weigths": "best"}) as args, pytest.raises(Exception) as info:
        _cli(args)
    assert "weigths" in str(info.value)


def _exception_chain(exc: BaseException) -> List[BaseException]:
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return chain


# ----------------------------------------------------------------------------------------- good configs


def test_defaults_and_every_accepted_form() -> None:
    assert FXFuseCallback().config == FuseConfig()
    cb = FXFuseCallback(
        target="backbone",
        weights=WeightsSource.best,
        trace=TraceConfig(mode="fx"),  # type: ignore[arg-type]
        passes=OmegaConf.create({"fuse_linear_bn": {"enabled": False}, "extra": ["remove_identity"]}),
        parity={"rtol": 1e-5, "on_failure": "warn", "input": "test_parity:pick_second"},
        export=ExportConfig(formats=["graph_module"]),  # type: ignore[list-item]
        on_error=OnError["warn"],
    )
    c = cb.config
    assert (c.target, c.weights.value, c.trace.mode.value) == ("backbone", "best", "fx")
    assert c.passes.fuse_linear_bn.enabled is False and c.passes.fuse_conv_bn.enabled is True
    assert [e.name for e in c.passes.extra] == ["remove_identity"]
    assert (c.parity.rtol, c.parity.on_failure.value, c.parity.max_batches) == (1e-5, "warn", 8)
    assert [f.value for f in c.export.formats] == ["graph_module"]
    assert c.on_error.value == "warn"


def test_hydra_instantiate_with_nested_options() -> None:
    node = OmegaConf.create({
        "_target_": "fx_lightning.FXFuseCallback",
        "weights": "best",
        "parity": {"max_batches": 3, "min_top1_agreement": 0.99},
        "passes": {"remove_dropout": {"remove_active_functional": True}},
        "export": {"enabled": False},
    })
    cb = instantiate(node)
    assert isinstance(cb, FXFuseCallback)
    assert cb.config.parity.max_batches == 3 and cb.config.parity.min_top1_agreement == 0.99
    assert cb.config.passes.remove_dropout.remove_active_functional is True
    assert cb.config.export.enabled is False and cb.config.weights.value == "best"


def test_shipped_callbacks_yaml_matches_the_schema_defaults() -> None:
    data = yaml.safe_load((CONFIGS / "callbacks" / "fx_fuse.yaml").read_text())
    node = data["fx_fuse"]
    assert node.pop("_target_") == "fx_lightning.FXFuseCallback"
    assert node == to_container(FuseConfig())
    assert instantiate(data["fx_fuse"] | {"_target_": "fx_lightning.FXFuseCallback"}).config == FuseConfig()


PRESETS = {
    "default": {},
    "strict": {"parity": {"data": "val", "max_batches": 32, "rtol": 1e-5, "min_cosine": 0.99999,
                          "min_top1_agreement": 1.0, "max_accuracy_drop": 0.0, "on_failure": "raise"}},
    "no_export": {"export": {"enabled": False}},
    "best": {"weights": "best"},
    "warn_only": {"on_error": "warn", "parity": {"on_failure": "warn"}},
    "template": {"export": {"dir": "/runs/2026-11-22/fx_fused"}},
    "serving": {"export": {"formats": ["pt2", "onnx", "openvino", "aoti"], "aoti_batch_sizes": [1, 8], "select": "fastest",
                           "select_batch_size": 1, "select_traffic": "idle"},
                "passes": {"quantize_int8": {"enabled": True}, "cast_bf16": {"enabled": True}}},
}


def test_every_preset_file_is_tested() -> None:
    assert {p.stem for p in (CONFIGS / "fx_fuse").glob("*.yaml")} == set(PRESETS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_compose_and_instantiate(preset: str) -> None:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        # paths.output_dir is ${hydra:runtime.output_dir}, which only a running app resolves.
        cfg = compose("train", overrides=[f"fx_fuse={preset}", "paths.output_dir=/runs/2026-11-22"])
    cb = instantiate(cfg.callbacks.fx_fuse)
    assert isinstance(cb, FXFuseCallback)
    expected = to_container(load_config(PRESETS[preset]))
    assert to_container(cb.config) == expected
    if preset != "default":
        assert to_container(cb.config) != to_container(FuseConfig())


def test_hydra_typo_in_override_is_rejected() -> None:
    # Rejected at instantiation, or already at composition once register_hydra_configs() has run.
    with pytest.raises(Exception, match=r"parity\.rtl"):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose("train", overrides=["+callbacks.fx_fuse.parity.rtl=0.1"])
        instantiate(cfg.callbacks.fx_fuse)


def test_register_hydra_configs_stores_a_structured_node() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf.errors import ConfigKeyError, ValidationError

    register_hydra_configs()
    node = ConfigStore.instance().load("callbacks/fx_fuse.yaml").node.fx_fuse
    cb = instantiate(node)
    assert isinstance(cb, FXFuseCallback) and cb.config == FuseConfig()
    # structured: Hydra users get typos and bad types rejected when their YAML is merged onto it
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(node, {"parity": {"rtl": 1}})
    with pytest.raises(ValidationError):
        OmegaConf.merge(node, {"weights": "bset"})
    # and the shipped YAML, which Hydra now matches onto that node, still composes and instantiates
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=["fx_fuse=strict"])
    assert instantiate(cfg.callbacks.fx_fuse).config.parity.rtol == 1e-5
    with pytest.raises(Exception, match="rtl"):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose("train", overrides=["+callbacks.fx_fuse.parity.rtl=0.1"])
        instantiate(cfg.callbacks.fx_fuse)


def test_lightning_cli_yaml_builds_the_callback(tmp_path: Path) -> None:
    args = ["--config", str(CONFIGS / "cli" / "train.yaml"), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}"]
    cli = _cli(args)
    callbacks = [cb for cb in cli.trainer.callbacks if isinstance(cb, FXFuseCallback)]
    assert len(callbacks) == 1
    c = callbacks[0].config
    assert c.weights.value == "best" and c.parity.max_batches == 8 and math.isclose(c.parity.rtol, 1e-4)
