"""``fx-lightning mlflow DIR``: log an export into an MLflow run as a pyfunc model (and register it), after the fact
or without Lightning: the callback's ``export.mlflow`` step, from the command line."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from fx_lightning.cli.common import UsageError
from fx_lightning.config import MlflowConfig
from fx_lightning.errors import ConfigError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    defaults = MlflowConfig()
    cmd = sub.add_parser(
        "mlflow", help="log an export into an MLflow run as a pyfunc model, and register it",
        description="Logs the export directory (every file checked against its manifest first) as an MLflow model: "
                    "a pyfunc over the export's checked loader, with a tensor signature and input example from the "
                    "export, the pip requirements of the artifact it serves, and the parity verdict, gate figures, "
                    "selected artifact and CPU as tags. Loadable with mlflow.pyfunc.load_model and servable with "
                    "mlflow models serve. Needs the mlflow extra: pip install 'fx-lightning[mlflow]'.",
    )
    cmd.add_argument("directory", help="an export directory (holds manifest.json)")
    cmd.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                     help="the tracking server (default: $MLFLOW_TRACKING_URI), e.g. sqlite:///mlflow.db or "
                          "http://host:5000")
    cmd.add_argument("--run-id", default=None, help="the run to log into (default: a new run in --experiment)")
    cmd.add_argument("--experiment", default="fx-lightning",
                     help="the experiment of the new run when --run-id is not given (default fx-lightning)")
    cmd.add_argument("--artifact-path", default=defaults.artifact_path,
                     help=f"the logged model's name in the run (default {defaults.artifact_path})")
    cmd.add_argument("--format", default=None, metavar="FORMAT",
                     help="the format or variant the pyfunc serves (default: the export's selection)")
    cmd.add_argument("--register", default=None, metavar="NAME", help="register the model as a new version of NAME")
    cmd.add_argument("--alias", default=None, help="point this alias of NAME at the new version (needs --register)")
    cmd.add_argument("--registry-uri", default=None,
                     help="the model registry, when it is not the tracking server (default: $MLFLOW_REGISTRY_URI, "
                          "else the tracking server)")


def run(args: argparse.Namespace, console: Any) -> int:
    from fx_lightning.tracking import MlflowRun, log_export

    if not args.tracking_uri:
        raise UsageError("fx-lightning mlflow: give --tracking-uri (or set MLFLOW_TRACKING_URI), e.g. "
                         "sqlite:///mlflow.db or http://host:5000")
    options = MlflowConfig(enabled=True, artifact_path=args.artifact_path, format=args.format,
                           register_as=args.register, alias=args.alias, registry_uri=args.registry_uri)
    try:
        options.check()
    except ValueError as exc:
        flag = {"register_as": "--register", "artifact_path": "--artifact-path", "registry_uri": "--registry-uri"}
        key, _, rest = str(exc).partition(":")
        raise UsageError(f"fx-lightning mlflow: {flag.get(key, '--' + key)}:{_as_flags(rest)}") from None
    run_ = MlflowRun(args.tracking_uri, args.run_id, args.experiment, args.registry_uri)
    try:
        logged = log_export(args.directory, run_, options)
    except ConfigError as exc:  # the flags' names, not the config keys they stand for
        raise UsageError(f"fx-lightning mlflow: {_as_flags(str(exc))}") from None
    console.print(f"logged {args.directory} into run {logged.run_id} (serving {logged.served}):", markup=False)
    console.print(f"  {logged.run_uri}\n  {logged.model_uri}", markup=False)
    if logged.registered is not None:
        console.print(f"  {logged.registered.uri}" + (f"\n  models:/{logged.registered.name}@{logged.registered.alias}"
                                                      if logged.registered.alias else ""), markup=False)
    return 0


# The config keys an export.mlflow message names, as this command's flags: its advice ("set register_as too, or
# registry_uri: null") is followed on the command line ("set --register too, or no --registry-uri").
_FLAGS = (("format", "--format"), ("register_as", "--register"), ("registry_uri", "--registry-uri"),
          ("artifact_path", "--artifact-path"))


def _as_flags(text: str) -> str:
    for key, flag in _FLAGS:
        text = text.replace(f"export.mlflow.{key}", flag)
        if "_" in key:  # a bare word such as "format" is prose too
            text = re.sub(rf"(?<![\w.-]){key}: null", f"leave out {flag}", text)
            text = re.sub(rf"(?<![\w.-]){key}(?!\w)", flag, text)
    return text.replace("set leave out", "leave out").replace("(or null for its selection)",
                                                              "(or leave out --format for its selection)")
