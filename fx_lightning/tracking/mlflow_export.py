"""An export logged into an MLflow run as a pyfunc model, and registered as a model version.

:func:`log_export` is the one function every caller runs (the callback at the end of fit with its
``MLFlowLogger``'s run, ``fx-lightning mlflow DIR`` after the fact): the whole export directory becomes the model's
artifact, :mod:`fx_lightning.tracking.pyfunc` its model (logged as code: nothing is pickled), with a tensor
signature and an input example from the export's own signature and ``check.pt``, the pip requirements of the
artifact it serves, and the export's verdict and figures as tags on the run, the logged model and the model version.
:func:`check_destination` is what the preflight proves before training.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from fx_lightning._version import __version__
from fx_lightning.config import MlflowConfig
from fx_lightning.common.dtypes import BY_TORCH
from fx_lightning.errors import ConfigError, ExportError, first_line
from fx_lightning.export.check import read_check_file
from fx_lightning.export.manifest import Manifest, VariantOutcome, dist_version, read_manifest, verify_files
from fx_lightning.formats import FORMATS
from fx_lightning.common.rows import rows_of, take_rows
from fx_lightning.serve.artifact import ServeOptions, artifact_for
from fx_lightning.serve.contract import Contract

__all__ = ["EXPORT_ARTIFACT", "FORMAT_KEY", "TAG_PREFIX", "MlflowRun", "RegisteredVersion", "LoggedExport", "log_export",
           "check_destination", "pyfunc_serve_options", "model_signature", "pip_requirements", "export_tags"]

# The pyfunc's artifact key: the export directory, copied whole into the logged model.
EXPORT_ARTIFACT = "export"
# The pyfunc's model_config key naming the artifact it serves (absent: the export's selection).
FORMAT_KEY = "fx_lightning_format"
TAG_PREFIX = "fx_lightning."
# The batch size the pyfunc's artifact is chosen and warmed for (larger inputs run in pieces of the sizes warmed).
PYFUNC_BATCH_SIZE = 8
# Samples of check.pt in the logged input example (MLflow runs it through the loaded model when it logs).
EXAMPLE_SAMPLES = 2
DISTRIBUTION = "fx-lightning"
MAX_TAG = 5000  # MLflow's limit on a tag's value
_URI_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")


@dataclass(frozen=True)
class MlflowRun:
    """Where to log: the tracking server (``tracking_uri``; ``registry_uri``: the registry's, when it is elsewhere;
    None: MLflow's own, ``$MLFLOW_REGISTRY_URI`` else the tracking server), and the run (``run_id``; None: a new run
    in ``experiment``, ended once the model is logged)."""

    tracking_uri: str
    run_id: Optional[str] = None
    experiment: str = "fx-lightning"
    registry_uri: Optional[str] = None


@dataclass(frozen=True)
class RegisteredVersion:
    """The model version a logged export became: ``models:/<name>/<version>`` (and ``models:/<name>@<alias>``)."""

    name: str
    version: str
    alias: Optional[str] = None

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


@dataclass(frozen=True)
class LoggedExport:
    """What :func:`log_export` did: the run and logged model (``model_uri``: ``models:/<model_id>``; also loadable
    as ``runs:/<run_id>/<artifact_path>``), the artifact the pyfunc serves, and the version it was registered as."""

    run_id: str
    model_id: str
    model_uri: str
    artifact_path: str
    served: str
    tracking_uri: str
    registered: Optional[RegisteredVersion] = None

    @property
    def run_uri(self) -> str:
        return f"runs:/{self.run_id}/{self.artifact_path}"


def log_export(directory: Union[str, Path], run: MlflowRun, options: Optional[MlflowConfig] = None) -> LoggedExport:
    """Log the export in ``directory`` into ``run`` as a pyfunc model, and register it when
    ``options.register_as`` is set. Every file is checked against the manifest first; the export directory is
    only read. Raises :class:`ExportError` naming what failed (the step and MLflow's message), ``ConfigError`` for
    an option the export cannot honour (a ``format`` it does not hold)."""
    try:
        import mlflow
        from mlflow.models import Model
    except ImportError as exc:
        raise ConfigError(f"export.mlflow: logging into MLflow needs mlflow ({exc}): pip install "
                          "'fx-lightning[mlflow]'.") from None

    options = options or MlflowConfig()
    root = Path(directory)
    manifest = read_manifest(root)
    verify_files(root, manifest)
    served = _served_artifact(manifest, options)
    signature, example = model_signature(manifest), _input_example(root, manifest)
    tags = export_tags(manifest, served)
    with _client(run) as client:
        run_id, experiment_id, own_run = _resolve_run(client, run)
        status = "FAILED"
        try:
            logged = _step("create the logged model", lambda: mlflow.initialize_logged_model(
                name=options.artifact_path, source_run_id=run_id, experiment_id=experiment_id, tags=tags))
            try:
                info = _step("log the model", lambda: Model.log(
                    artifact_path=None, name=options.artifact_path, flavor=mlflow.pyfunc, run_id=run_id,
                    model_id=logged.model_id, python_model=str(Path(__file__).with_name("model_code.py")),
                    artifacts={EXPORT_ARTIFACT: str(root)}, code_paths=[str(Path(__file__).parents[1])],
                    # Given only when a format is chosen: MLflow also logs model_config as the run's parameters.
                    model_config={FORMAT_KEY: options.format} if options.format else None,
                    signature=signature, input_example=example,
                    pip_requirements=pip_requirements(manifest, served)))
            except ExportError:
                with contextlib.suppress(Exception):  # the model stays listed, marked FAILED
                    mlflow.finalize_logged_model(logged.model_id, "FAILED")
                raise
            _step("tag the run", lambda: [client.set_tag(run_id, key, value) for key, value in tags.items()])
            registered = _register(client, info.model_uri, run_id, options, tags) if options.register_as else None
            status = "FINISHED"
        finally:
            if own_run:  # a run made here ends here, FAILED when the model is not fully logged
                with contextlib.suppress(Exception):
                    client.set_terminated(run_id, status)
    return LoggedExport(run_id, logged.model_id, info.model_uri, options.artifact_path, served, run.tracking_uri,
                        registered)


def check_destination(run: MlflowRun, options: MlflowConfig) -> None:
    """What can be proven before training: MLflow imports, the tracking server answers and holds the run, and the
    registry answers when a model is to be registered. Raises :class:`ConfigError` naming the key and the cause."""
    try:
        import mlflow
    except ImportError as exc:
        raise ConfigError(f"export.mlflow: logging the export into MLflow needs mlflow ({exc}): pip install "
                          "'fx-lightning[mlflow]', or set export.mlflow.enabled: false.") from None
    with _client(run) as client:
        try:
            if run.run_id is not None:
                client.get_run(run.run_id)
            else:
                client.search_experiments(max_results=1)
        except Exception as exc:  # noqa: BLE001 - any failure to reach the store is the answer
            raise ConfigError(f"export.mlflow: the tracking server {run.tracking_uri!r} does not answer"
                              + (f" for run {run.run_id}" if run.run_id else "")
                              + f": {type(exc).__name__}: {first_line(exc)}. Fix the MLFlowLogger's tracking_uri, or "
                                "set export.mlflow.enabled: false.") from None
        if options.register_as:
            try:
                client.search_registered_models(max_results=1)
            except Exception as exc:  # noqa: BLE001
                key = "registry_uri" if run.registry_uri else "register_as"
                raise ConfigError(f"export.mlflow.{key}: the model registry at {mlflow.get_registry_uri()!r} does not "
                                  f"answer, so {options.register_as!r} cannot be registered: {type(exc).__name__}: "
                                  f"{first_line(exc)}. Fix the registry URI, or set register_as: null"
                                  # registry_uri without register_as is refused: both go
                                  + (" and registry_uri: null." if options.registry_uri else ".")) from None


def model_signature(manifest: Manifest) -> Any:
    """The MLflow tensor signature of the export: each input named, typed and shaped as the manifest records (the
    sample axis and every dynamic dimension -1); each output likewise when numpy has its dtype."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    contract = _contract(manifest)

    def shape(sizes: Sequence[Optional[int]]) -> Tuple[int, ...]:
        return tuple(-1 if d is None else d for d in sizes)

    inputs = [TensorSpec(np.dtype(leaf.dtype), ((-1,) if contract.batched else ())
                         + shape(contract.request_sizes(leaf)), leaf.name) for leaf in contract.inputs]
    outputs = None  # stated only when numpy has every output's dtype
    stated = [(leaf, BY_TORCH.get(leaf.dtype)) for leaf in contract.outputs]
    if stated and all(d is not None for _, d in stated):
        outputs = Schema([TensorSpec(np.dtype(d.numpy), shape(leaf.sizes(contract.any_samples)),
                                     leaf.name if len(stated) > 1 else None) for leaf, d in stated])
    return ModelSignature(inputs=Schema(inputs), outputs=outputs)


def pip_requirements(manifest: Manifest, served: str) -> List[str]:
    """What the pyfunc needs installed: fx-lightning's own dependencies (its code travels with the model), numpy, and
    the runtime of the artifact it serves (ONNX Runtime, OpenVINO, torchao for int8...), each pinned to the version
    the export recorded (``manifest.versions``: what made and checked the artifact), else the one installed here;
    local version labels (``+cpu``) are dropped, since no package index serves them."""
    try:
        declared = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        declared = ["torch"]
    names = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0]: r for r in declared if "extra ==" not in r}
    entry = manifest.formats[served]
    fmt = FORMATS[entry.format_name or served]
    distributions = importlib.metadata.packages_distributions()
    for module in [*fmt.runtime_requires, *entry.imports]:
        for name in distributions.get(module.split(".")[0], [module]):
            names.setdefault(name, module)
    names.setdefault("numpy", "numpy")
    pinned: List[str] = []
    for name, module in names.items():
        version = manifest.versions.get(name) or manifest.versions.get(module) or dist_version(name)
        pinned.append(f"{name}=={version.split('+')[0]}" if version else name)
    return pinned


def export_tags(manifest: Manifest, served: str) -> Dict[str, str]:
    """The export's verdict and figures as MLflow tags: parity (passed, each gate figure and threshold), the artifact
    served and its timing, the CPU it was chosen on, the variants made, fx-lightning's version."""
    tags: Dict[str, str] = {"version": __version__, "served_artifact": served,
                            "formats": ",".join(manifest.formats), "created_utc": manifest.created_utc}
    if manifest.parity is not None:
        tags["parity.passed"] = str(manifest.parity.passed).lower()
        tags["parity.batches"] = str(manifest.parity.batches)
        tags.update({f"parity.{k}": f"{v:.6g}" for k, v in manifest.parity.metrics.items()})
        tags.update({f"parity.threshold.{k}": f"{v:.6g}" for k, v in manifest.parity.thresholds.items()})
    if manifest.selected is not None:
        tags.update({"selected": manifest.selected.format, "selected.batch_size": str(manifest.selected.batch_size),
                     "selected.median_ms": f"{manifest.selected.median_ms:.4g}",
                     "selected.traffic": manifest.selected.traffic})
    if manifest.bench is not None:
        tags.update({"cpu": manifest.bench.machine, "cpu.isa": manifest.bench.isa,
                     "bench.threads": str(manifest.bench.threads)})
    for outcomes in manifest.variants.values():
        for outcome in outcomes:
            tags[f"variant.{outcome.entry}"] = _variant_verdict(outcome)
    return {TAG_PREFIX + k: v for k, v in tags.items()}


# ---------------------------------------------------------------------------------------------------- helpers


def _variant_verdict(outcome: VariantOutcome) -> str:
    """``kept``, or why not: skipped on this CPU, failed to build, or the gate it missed (a tag holds 5000 chars)."""
    if outcome.kept:
        return "kept"
    if outcome.skipped:
        return f"skipped: {outcome.skipped}"[:MAX_TAG]
    if outcome.error:
        return f"failed: {outcome.error}"[:MAX_TAG]
    failures = "; ".join(str(f) for f in outcome.gate.failures) if outcome.gate is not None else ""
    return f"dropped: {failures or 'gate missed'}"[:MAX_TAG]


def _served_artifact(manifest: Manifest, options: MlflowConfig) -> str:
    """The artifact the pyfunc serves: ``options.format`` when the export holds it, else its selection."""
    if options.format is not None and options.format not in manifest.formats:
        raise ConfigError(f"export.mlflow.format: {options.format!r} is not in the export; it holds "
                          f"{', '.join(manifest.formats)} (or null for its selection).")
    return artifact_for(manifest, pyfunc_serve_options(options.format))[0]


def pyfunc_serve_options(format: Optional[str]) -> ServeOptions:
    """How the pyfunc loads the export: ``format`` (None: the selection for batches of :data:`PYFUNC_BATCH_SIZE`,
    with the runtime settings that made it fastest), warmed for the batch sizes up to that."""
    return ServeOptions(format=format, max_batch_size=PYFUNC_BATCH_SIZE)


def _contract(manifest: Manifest) -> Contract:
    try:
        return Contract.of(manifest)
    except ValueError as exc:
        raise ExportError(f"the export cannot be logged as an MLflow pyfunc with a tensor signature: {exc}") from None


def _input_example(root: Path, manifest: Manifest) -> Optional[Dict[str, np.ndarray]]:
    """A few samples of ``check.pt``'s inputs, keyed by input name (None when the export has no check.pt)."""
    saved = read_check_file(root)
    if saved is None:
        return None
    contract = _contract(manifest)
    inputs = list(saved.inputs)
    if contract.batched:
        axes = [0] * len(inputs)
        inputs = list(take_rows(tuple(inputs), axes, 0, min(EXAMPLE_SAMPLES, rows_of(tuple(inputs), axes) or 1)))
    return {spec.name: t.numpy() for spec, t in zip(contract.inputs, inputs)}


def _resolve_run(client: Any, run: MlflowRun) -> Tuple[str, str, bool]:
    """The run to log into, its experiment, and whether it was made here (then ended here)."""
    if run.run_id is not None:
        found = _step(f"find run {run.run_id}", lambda: client.get_run(run.run_id))
        return run.run_id, found.info.experiment_id, False
    experiment = _step(f"find experiment {run.experiment!r}", lambda: client.get_experiment_by_name(run.experiment))
    experiment_id = experiment.experiment_id if experiment is not None else _step(
        f"create experiment {run.experiment!r}", lambda: client.create_experiment(run.experiment))
    made = _step("create a run", lambda: client.create_run(experiment_id, run_name="fx-lightning export"))
    return made.info.run_id, experiment_id, True


def _register(client: Any, model_uri: str, run_id: str, options: MlflowConfig,
              tags: Dict[str, str]) -> RegisteredVersion:
    """A new version of ``options.register_as`` (the registered model made when missing), tagged, and the alias."""
    import mlflow

    name = options.register_as
    assert name is not None
    version = _step(f"register the model as {name!r}", lambda: mlflow.register_model(
        model_uri, name, tags=tags, await_registration_for=60))
    if options.alias:
        _step(f"set alias {options.alias!r} on {name!r} version {version.version}",
              lambda: client.set_registered_model_alias(name, options.alias, version.version))
    return RegisteredVersion(name, str(version.version), options.alias)


def _step(what: str, call: Any) -> Any:
    """``call()``, with a failure raised as an :class:`ExportError` saying what was being done."""
    try:
        return call()
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - MLflow raises its own and its stores' exceptions
        raise ExportError(f"MLflow: could not {what}: {type(exc).__name__}: {first_line(exc)}") from exc


@contextlib.contextmanager
def _client(run: MlflowRun) -> Iterator[Any]:
    """A client of ``run``'s tracking server (and registry), with MLflow's process-wide tracking (and registry) URI
    set to them for the block, then put back as it was: its model-logging functions read them, and the caller's own
    MLflow use must not be redirected. MLflow keeps each in a module global and mirrors it in an environment
    variable (for subprocesses): both are restored."""
    import mlflow

    saved = {name: os.environ.get(name) for name in _URI_VARIABLES}
    mlflow.set_tracking_uri(run.tracking_uri)
    if run.registry_uri is not None:
        mlflow.set_registry_uri(run.registry_uri)
    try:
        yield mlflow.MlflowClient(run.tracking_uri, registry_uri=run.registry_uri)
    finally:
        # Unset, then the variables as they were: a URI the caller had set is still resolved from its variable.
        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]
        mlflow.set_registry_uri(None)  # type: ignore[arg-type]
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
