"""``export.mlflow`` and ``fx-lightning mlflow``: the verified export logged into an MLflow run and registry, against
a real MLflow tracking store (SQLite under a temporary directory), no mocks. A fresh process loads it with
``mlflow.pyfunc.load_model`` by run and by registry URI, ``mlflow models serve`` answers ``/invocations`` with it, and
every answer is compared with ``load_fused`` and with the original model in fp64."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest
import torch

from export_helpers import clean_env, free_port
from fusion_helpers import reference_fp64, rel_err
from lightning_helpers import LitClassifier, loaders, make_trainer
from fx_lightning import FXFuseCallback, load_fused
from fx_lightning.config import MlflowConfig, load_config
from fx_lightning.errors import ConfigError
from fx_lightning.export.manifest import read_manifest, verify_files

mlflow = pytest.importorskip("mlflow")
from lightning.pytorch.loggers import MLFlowLogger  # noqa: E402  (needs mlflow)

from fx_lightning.tracking import (  # noqa: E402
    MlflowRun,
    export_tags,
    log_export,
    model_signature,
    pip_requirements,
)

# The export's own tolerance for another process and runtime (check.pt's artifacts pass within it).
TOLERANCE = 1e-4
SERVE_STARTUP_S = 180.0
REGISTERED = "tiny-classifier"


def _fit(tmp: Path, export: Dict[str, Any], on_error: str = "raise", callbacks: List[Any] = ()) -> Any:
    logger = MLFlowLogger(experiment_name="digits", tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                          artifact_location=str(tmp / "artifacts"))
    model = LitClassifier()
    callback = FXFuseCallback(export={"dir": str(tmp / "fx_fused"), "formats": ["pt2", "onnx"], **export},
                              on_error=on_error)
    trainer = make_trainer(tmp, [callback, *callbacks], logger=logger)
    trainer.fit(model, *loaders())
    return model, callback, logger


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("mlflow_fit")
    model, callback, logger = _fit(tmp, {"mlflow": {"register_as": REGISTERED, "alias": "candidate"}})
    x = next(iter(loaders()[1]))[0]
    yield {"tmp": tmp, "model": model, "callback": callback, "logger": logger, "x": x,
           "uri": f"sqlite:///{tmp}/mlflow.db"}


def _predict_in_fresh_process(tmp: Path, tracking_uri: str, uris: List[str], x: torch.Tensor) -> Dict[str, Any]:
    """Each model URI loaded by mlflow.pyfunc.load_model in a new interpreter outside the repository, run on ``x``."""
    np.save(tmp / "x.npy", x.numpy())
    script = (
        "import json, sys, numpy as np, mlflow\n"
        "x = np.load(sys.argv[1]); out = {}\n"
        "for uri in sys.argv[3:]:\n"
        "    m = mlflow.pyfunc.load_model(uri)\n"
        "    name = m.metadata.get_input_schema().input_names()[0]\n"
        "    y = m.predict({name: x})\n"
        "    np.save(f'{sys.argv[2]}/{len(out)}.npy', y); out[uri] = [str(y.dtype), list(y.shape)]\n"
        "print(json.dumps(out))\n")
    env = {**clean_env(), "MLFLOW_TRACKING_URI": tracking_uri}
    done = subprocess.run([sys.executable, "-c", script, str(tmp / "x.npy"), str(tmp), *uris], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shapes = json.loads(done.stdout.strip().splitlines()[-1])
    return {uri: (shapes[uri], np.load(tmp / f"{i}.npy")) for i, uri in enumerate(uris)}


def test_fit_with_mlflow_logger_logs_the_export_into_its_run_and_registers_it(fitted: Dict[str, Any]) -> None:
    callback, logger = fitted["callback"], fitted["logger"]
    logged = callback.mlflow
    assert logged is not None and logged.run_id == logger.run_id
    client = mlflow.MlflowClient(fitted["uri"])
    run = client.get_run(logger.run_id)
    assert [o.model_id for o in run.outputs.model_outputs] == [logged.model_id]  # the model is the run's output
    assert run.data.tags["fx_lightning.parity.passed"] == "true"
    assert run.data.tags["fx_lightning.served_artifact"] == logged.served
    assert float(run.data.metrics["fx_fuse/parity_passed"]) == 1.0  # the callback's figures, in the same run
    # The registered version: its tags carry the verdict and the gate figures; the alias points at it.
    assert logged.registered is not None and (logged.registered.name, logged.registered.version) == (REGISTERED, "1")
    version = client.get_model_version(REGISTERED, "1")
    manifest = read_manifest(callback.export_dir)
    assert version.tags == export_tags(manifest, logged.served)
    assert version.tags["fx_lightning.parity.passed"] == "true"
    assert float(version.tags["fx_lightning.parity.relative_max_error"]) == pytest.approx(
        manifest.parity.metrics["relative_max_error"], rel=1e-5)
    assert str(client.get_model_version_by_alias(REGISTERED, "candidate").version) == "1"
    assert any("logged to MLflow" in str(n) for n in callback.outcome.notes)
    # The export directory is whole and unchanged by the logging.
    verify_files(callback.export_dir, manifest)


def test_pyfunc_in_a_fresh_process_answers_as_load_fused_and_the_fp64_original(fitted: Dict[str, Any]) -> None:
    callback, x = fitted["callback"], fitted["x"]
    logged = callback.mlflow
    uris = [logged.run_uri, logged.model_uri, f"models:/{REGISTERED}/1", f"models:/{REGISTERED}@candidate"]
    answers = _predict_in_fresh_process(fitted["tmp"], fitted["uri"], uris, x)
    with torch.no_grad():
        expected = load_fused(callback.export_dir)(x)
    original = reference_fp64(fitted["model"].backbone, x)
    for uri, ((dtype, shape), y) in answers.items():
        assert (dtype, shape) == ("float32", list(expected.shape)), uri
        assert rel_err(torch.from_numpy(y), expected) < TOLERANCE, uri
        assert rel_err(torch.from_numpy(y), original) < TOLERANCE, uri


def test_mlflow_models_serve_answers_invocations_with_the_same_outputs(fitted: Dict[str, Any]) -> None:
    callback, x, tmp = fitted["callback"], fitted["x"], fitted["tmp"]
    port = free_port()
    # As a user with the environment activated runs it: MLflow starts uvicorn from PATH.
    env = {**clean_env(), "MLFLOW_TRACKING_URI": fitted["uri"], "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = open(tmp / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{REGISTERED}@candidate",
         "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
        cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/ping", server, tmp / "serve.log")
        name = read_manifest(callback.export_dir).call_signature().inputs[0].name
        body = json.dumps({"inputs": {name: x.tolist()}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        predictions = torch.tensor(answer["predictions"])
        with torch.no_grad():
            expected = load_fused(callback.export_dir)(x)
        assert predictions.shape == expected.shape
        assert rel_err(predictions, expected) < TOLERANCE
        # A request the export's contract refuses: a 4xx naming the input, and the server keeps serving.
        bad = json.dumps({"inputs": {name: x[:, :2].tolist()}}).encode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/invocations", bad,
                                                          {"Content-Type": "application/json"}), timeout=60)
        assert 400 <= refused.value.code < 500
        assert name in refused.value.read().decode()
    finally:
        _stop(server)
        log.close()


def _stop(server: subprocess.Popen) -> None:
    """The server's whole process group (mlflow's CLI and the uvicorn it execs), by PID: SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            pass
        try:
            server.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_ready(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVE_STARTUP_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow models serve exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    pytest.fail(f"mlflow models serve did not answer {url} within {SERVE_STARTUP_S:.0f} s:\n{log.read_text()[-3000:]}")


def test_a_registry_failure_after_export_leaves_the_export_and_checkpoints_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow makes the directories of a SQLite path relative to the working directory ("file:..." here): keep them in tmp.
    monkeypatch.chdir(tmp_path)
    # A registry that answers reads (the preflight's check passes) and refuses writes: SQLite opened read-only.
    registry = tmp_path / "registry.db"
    mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db", registry_uri=f"sqlite:///{registry}"
                        ).search_registered_models(max_results=1)  # makes its tables
    read_only = f"sqlite:///file:{registry}?mode=ro&uri=true"
    with pytest.warns(UserWarning) as caught:
        model, callback, logger = _fit(tmp_path, {"mlflow": {"register_as": REGISTERED, "registry_uri": read_only}},
                                       on_error="warn")
    message = "\n".join(str(w.message) for w in caught if "FXFuseCallback failed" in str(w.message))
    assert "register the model" in message and "readonly" in message.replace("read-only", "readonly").lower()
    assert f"The export in {callback.export_dir} is complete" in message
    assert "fx-lightning mlflow" in message and logger.run_id in message  # how to log it again
    assert callback.mlflow is None and callback.export_dir is not None
    manifest = read_manifest(callback.export_dir)
    verify_files(callback.export_dir, manifest)  # every file as the manifest lists it
    x = next(iter(loaders()[1]))[0]
    with torch.no_grad():
        assert rel_err(load_fused(callback.export_dir)(x), reference_fp64(model.backbone, x)) < TOLERANCE
    checkpoints = list((tmp_path).rglob("*.ckpt"))
    assert checkpoints and all(c.stat().st_size > 0 for c in checkpoints)


def test_preflight_refuses_before_training(tmp_path: Path) -> None:
    # enabled: true without an MLFlowLogger.
    model = LitClassifier()
    trainer = make_trainer(tmp_path, [FXFuseCallback(export={"dir": str(tmp_path / "a"), "mlflow": {"enabled": True}})])
    with pytest.raises(ConfigError, match=r"export\.mlflow\.enabled: true, but the Trainer has no MLFlowLogger"):
        trainer.fit(model, *loaders())
    assert model.training_steps == 0
    # A registry that does not answer (its database under a path that is a file: it cannot be opened or made).
    model = LitClassifier()
    (tmp_path / "a_file").write_text("not a directory")
    missing = f"sqlite:///{tmp_path}/a_file/registry.db"
    logger = MLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
                          artifact_location=str(tmp_path / "artifacts"))
    callback = FXFuseCallback(export={"dir": str(tmp_path / "b"),
                                      "mlflow": {"register_as": "m", "registry_uri": missing}})
    trainer = make_trainer(tmp_path, [callback], logger=logger)
    with pytest.raises(ConfigError, match=r"export\.mlflow\.registry_uri: the model registry at .* does not answer"):
        trainer.fit(model, *loaders())
    assert model.training_steps == 0
    assert not (tmp_path / "b").exists()


def test_no_mlflow_logger_and_enabled_null_logs_nothing(tmp_path: Path) -> None:
    callback = FXFuseCallback(export={"dir": str(tmp_path / "fx_fused"), "formats": ["pt2"]})
    make_trainer(tmp_path, [callback]).fit(LitClassifier(), *loaders())
    assert callback.export_dir is not None and callback.mlflow is None
    assert not any("MLflow" in str(n) for n in callback.outcome.notes)


@pytest.mark.parametrize("options, key", [
    ({"alias": "candidate"}, "export.mlflow.alias"),
    ({"register_as": "a/b"}, "export.mlflow.register_as"),
    ({"register_as": ".."}, "export.mlflow.register_as"),
    ({"register_as": "."}, "export.mlflow.register_as"),
    ({"register_as": "..x"}, "export.mlflow.register_as"),
    ({"register_as": "m", "alias": "latest"}, "export.mlflow.alias"),
    ({"register_as": "m", "alias": "v2"}, "export.mlflow.alias"),
    ({"artifact_path": "a.b"}, "export.mlflow.artifact_path"),
    ({"format": "tflite"}, "export.mlflow.format"),
    ({"format": "onnx-int4"}, "export.mlflow.format"),
    ({"registry_uri": "sqlite:///r.db"}, "export.mlflow.registry_uri"),
])
def test_bad_options_are_refused_naming_the_key(options: Dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(export={"mlflow": options})
    assert str(refused.value).startswith(key)
    value = next(iter(v for k, v in options.items() if key.endswith(k)))
    assert repr(value) in str(refused.value)


# ------------------------------------------------------------------------- fx-lightning mlflow, the records


@pytest.fixture(scope="module")
def two_input_export(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """An export of a model with two named inputs and two outputs (no Lightning)."""
    from fx_lightning import fuse_and_export

    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.bn = torch.nn.BatchNorm2d(4)
            self.head = torch.nn.Linear(4 + 5, 3)

        def forward(self, image: torch.Tensor, extra: torch.Tensor) -> Any:
            features = self.bn(self.conv(image)).mean((2, 3))
            return self.head(torch.cat([features, extra], 1)), features

    torch.manual_seed(0)
    model = TwoInputs()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    model.eval()
    tmp = tmp_path_factory.mktemp("mlflow_cli")
    batches = [(torch.randn(6, 3, 10, 10), torch.randn(6, 5)) for _ in range(2)]
    fuse_and_export(model, tmp / "export", example_inputs=batches[0], config={"export": {"formats": ["pt2", "onnx"]}})
    return {"tmp": tmp, "model": model, "inputs": batches[1], "dir": tmp / "export"}


def test_cli_logs_an_export_after_the_fact_and_registers_it(two_input_export: Dict[str, Any]) -> None:
    tmp, directory = two_input_export["tmp"], two_input_export["dir"]
    uri = f"sqlite:///{tmp}/cli.db"
    command = [sys.executable, "-m", "fx_lightning", "mlflow", str(directory), "--tracking-uri", uri,
               "--register", "two-inputs", "--alias", "prod", "--format", "onnx"]
    done = subprocess.run(command, cwd=tmp, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "models:/two-inputs/1" in done.stdout and "models:/two-inputs@prod" in done.stdout
    version = mlflow.MlflowClient(uri).get_model_version("two-inputs", "1")
    assert version.tags["fx_lightning.served_artifact"] == "onnx"
    # Loaded here (MLflow's loader, the model's own code path), called with both named inputs.
    mlflow.set_tracking_uri(uri)
    try:
        pyfunc = mlflow.pyfunc.load_model("models:/two-inputs@prod")
    finally:
        mlflow.set_tracking_uri(None)
    image, extra = two_input_export["inputs"]
    answer = pyfunc.predict({"image": image.numpy(), "extra": extra.numpy()})
    assert isinstance(answer, dict) and len(answer) == 2
    reference = reference_fp64(two_input_export["model"], (image, extra))
    for got, want in zip(answer.values(), reference):
        assert got.shape == tuple(want.shape) and got.dtype == np.float32
        assert rel_err(torch.from_numpy(got), want) < TOLERANCE
    # One input missing: refused naming what is expected.
    with pytest.raises(mlflow.exceptions.MlflowException, match="extra"):
        pyfunc.predict({"image": image.numpy()})


@pytest.mark.parametrize("argv, says", [
    (["--tracking-uri", "sqlite:///x.db", "--alias", "prod"], "--alias"),
    (["--tracking-uri", "sqlite:///x.db", "--register", "a:b"], "--register"),
    ([], "--tracking-uri"),
])
def test_cli_usage_errors(two_input_export: Dict[str, Any], argv: List[str], says: str) -> None:
    env = {k: v for k, v in clean_env().items() if k != "MLFLOW_TRACKING_URI"}
    done = subprocess.run([sys.executable, "-m", "fx_lightning", "mlflow", str(two_input_export["dir"]), *argv],
                          cwd=two_input_export["tmp"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and says in done.stderr + done.stdout


def test_cli_refuses_a_format_the_export_does_not_hold(two_input_export: Dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"export\.mlflow\.format: 'openvino' is not in the export; it holds pt2, onnx"):
        log_export(two_input_export["dir"], MlflowRun(f"sqlite:///{tmp_path}/x.db"), MlflowConfig(format="openvino"))


def test_signature_requirements_and_tags_come_from_the_export(two_input_export: Dict[str, Any]) -> None:
    manifest = read_manifest(two_input_export["dir"])
    signature = model_signature(manifest).to_dict()
    inputs = json.loads(signature["inputs"])
    assert [(i["name"], i["tensor-spec"]["dtype"], i["tensor-spec"]["shape"]) for i in inputs] == [
        ("image", "float32", [-1, 3, -1, -1]), ("extra", "float32", [-1, 5])]  # height and width shown to vary
    outputs = json.loads(signature["outputs"])
    assert [o["tensor-spec"]["shape"] for o in outputs] == [[-1, 3], [-1, 4]]
    onnx = pip_requirements(manifest, "onnx")
    pt2 = pip_requirements(manifest, "pt2")
    assert any(r.startswith("onnxruntime==") for r in onnx) and not any(r.startswith("onnxruntime") for r in pt2)
    assert any(r.startswith("torch==") for r in pt2)
    tags = export_tags(manifest, "pt2")
    assert tags["fx_lightning.parity.passed"] == str(manifest.parity.passed).lower()
    assert all(k.startswith("fx_lightning.") and isinstance(v, str) for k, v in tags.items())


# ------------------------------------------------------------------------------------ review: edge cases


def test_tags_say_why_each_variant_was_not_kept(two_input_export: Dict[str, Any]) -> None:
    import dataclasses

    from fx_lightning.export.manifest import VariantOutcome
    from fx_lightning.parity.report import ParityReport

    manifest = read_manifest(two_input_export["dir"])
    missed = ParityReport(False, {"top1_agreement": 0.9}, failures=[])
    variants = {"int8": [VariantOutcome("onnx-int8", True), VariantOutcome("pt2-int8", False, error="no kernel"),
                         VariantOutcome("openvino-int8", False, gate=missed)],
                "bf16": [VariantOutcome("pt2-bf16", False, skipped="the CPU has no avx512_bf16")]}
    tags = export_tags(dataclasses.replace(manifest, variants=variants), "pt2")
    assert tags["fx_lightning.variant.onnx-int8"] == "kept"
    assert tags["fx_lightning.variant.pt2-int8"] == "failed: no kernel"
    assert tags["fx_lightning.variant.openvino-int8"].startswith("dropped")
    assert tags["fx_lightning.variant.pt2-bf16"] == "skipped: the CPU has no avx512_bf16"


def test_one_row_export_and_the_callers_mlflow_state_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """check.pt of one sample gives a one-sample input example; the process's MLflow URIs and their environment
    variables are as they were after logging elsewhere; the pyfunc refuses a NaN itself, naming the input."""
    from fx_lightning import fuse_and_export

    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)).eval()
    model[1].running_mean.uniform_(-1, 1)
    fuse_and_export(model, tmp_path / "export", example_inputs=(torch.randn(1, 6),), config={"export": {"formats": ["pt2"]}})
    monkeypatch.chdir(tmp_path)  # the run made for it goes to a new experiment, whose artifacts MLflow puts in ./mlruns
    users = f"sqlite:///{tmp_path}/users.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", users)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    before = (mlflow.get_tracking_uri(), mlflow.get_registry_uri(), os.environ.get("MLFLOW_TRACKING_URI"),
              os.environ.get("MLFLOW_REGISTRY_URI"))
    ours = f"sqlite:///{tmp_path}/ours.db"
    logged = log_export(tmp_path / "export", MlflowRun(ours), MlflowConfig(register_as="one-row"))
    after = (mlflow.get_tracking_uri(), mlflow.get_registry_uri(), os.environ.get("MLFLOW_TRACKING_URI"),
             os.environ.get("MLFLOW_REGISTRY_URI"))
    assert after == before == (users, users, users, None)
    client = mlflow.MlflowClient(ours)
    assert client.get_run(logged.run_id).info.status == "FINISHED"  # the run made for it, ended
    assert "format" not in client.get_run(logged.run_id).data.params
    monkeypatch.setenv("MLFLOW_TRACKING_URI", ours)
    pyfunc = mlflow.pyfunc.load_model(logged.registered.uri)
    name = pyfunc.metadata.get_input_schema().input_names()[0]
    x = torch.randn(3, 6)
    got = pyfunc.predict({name: x.numpy()})
    assert got.shape == (3, 4) and rel_err(torch.from_numpy(got), reference_fp64(model, x)) < TOLERANCE
    bad = x.numpy().copy()
    bad[1, 2] = np.nan
    with pytest.raises(mlflow.exceptions.MlflowException, match=rf"input '{name}': 1 NaN or infinite"):
        pyfunc.predict({name: bad})


def test_preflight_capture_refuses_enabled_without_a_logger_and_export_off_is_refused(tmp_path: Path) -> None:
    model = LitClassifier()
    callback = FXFuseCallback(export={"dir": str(tmp_path / "a"), "mlflow": {"enabled": True}}, preflight="capture")
    with pytest.raises(ConfigError, match=r"export\.mlflow\.enabled: true, but the Trainer has no MLFlowLogger"):
        make_trainer(tmp_path, [callback]).fit(model, *loaders())
    assert model.training_steps == 0
    with pytest.raises(ConfigError, match=r"export\.mlflow\.enabled: true while export\.enabled is false"):
        FXFuseCallback(export={"enabled": False, "mlflow": {"enabled": True}})


def test_log_again_command_repeats_the_options(tmp_path: Path) -> None:
    from fx_lightning.callback.mlflow_logging import log_again_command

    config = load_config(export={"mlflow": {"register_as": "my model", "alias": "candidate", "format": "onnx"}})
    command = log_again_command(tmp_path / "fx fused", MlflowRun("sqlite:///m.db", "abc"), config)
    assert command == (f"fx-lightning mlflow '{tmp_path / 'fx fused'}' --tracking-uri sqlite:///m.db --run-id abc "
                       "--artifact-path fx_fused --format onnx --register 'my model' --alias candidate")
