"""The real engines: a Triton model repository written by ``fx-lightning triton`` loads in a real tritonserver (the
``nvidia-pytriton`` wheel's, CPU, Python backend; ``tests/engines.py``), every model answers ``tritonclient``'s
binary requests within the export's tolerance of ``check.pt``, ``fx-lightning serve`` answers the same requests
through the Open Inference Protocol with the same outputs and the same metadata, ``perf_analyzer`` runs against
both with no error, and a bad request gets a 4xx naming the problem from each."""

from __future__ import annotations

import csv
import json
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest
import torch

from engines import Engines, engines_dir
from fusion_helpers import reference_fp64, rel_err
from fx_lightning.config.schema import ExportFormat
from fx_lightning.export.check import read_check_file
from fx_lightning.serve.triton import write_triton_repository
from test_http_server import TwoHeads, _export, running_server

http = pytest.importorskip("tritonclient.http")
pytest.importorskip("litserve")

# fp32 artifacts against the fp64 outputs saved at export: the tolerance every export check uses for them.
EXPORT_RTOL = 1e-4


@pytest.fixture(scope="module")
def engines() -> Engines:
    found = Engines(engines_dir())
    why = found.missing()
    if why is not None and "no Python backend stub" in why:
        pytest.skip(why)
    assert why is None, why
    return found


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """TwoHeads exported in the four formats Triton serves (two on the Python backend, two on their own), and
    its repository."""
    tmp = tmp_path_factory.mktemp("triton_server")
    torch.manual_seed(0)
    model = TwoHeads().eval()
    directory = _export(model, tmp / "twoheads",
                        [ExportFormat.pt2, ExportFormat.aoti, ExportFormat.onnx, ExportFormat.openvino])
    repository = write_triton_repository(directory, tmp / "repository")
    return {"tmp": tmp, "dir": directory, "model": model, "repository": repository}


@pytest.fixture(scope="module")
def triton(engines: Engines, exported: Dict[str, Any]) -> Iterator[str]:
    work = exported["tmp"] / "triton"
    work.mkdir()
    with engines.tritonserver(exported["repository"].root, work) as url:
        yield url


@pytest.fixture(scope="module")
def served(exported: Dict[str, Any]) -> Iterator[str]:
    with running_server(exported["dir"], exported["tmp"], "--max-batch-size", "4") as url:
        yield url.removeprefix("http://")


def _infer(url: str, name: str, x: np.ndarray) -> Dict[str, np.ndarray]:
    """One request as tritonclient sends it by default (binary tensors both ways)."""
    client = http.InferenceServerClient(url)
    given = http.InferInput("x", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = client.infer(name, [given])
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


def test_the_repository_holds_every_kind_of_model(exported: Dict[str, Any]) -> None:
    backends = {m.name: m.backend for m in exported["repository"].models}
    assert backends == {"twoheads": "python", "twoheads_pt2": "python", "twoheads_aoti": "python",
                        "twoheads_onnx": "onnxruntime", "twoheads_openvino": "openvino"}


def test_every_model_loads_in_tritonserver_and_answers_within_the_exports_tolerance(
        triton: str, exported: Dict[str, Any]) -> None:
    saved = read_check_file(exported["dir"])
    assert saved is not None
    x = saved.inputs[0]
    reference = reference_fp64(exported["model"], x)
    client = http.InferenceServerClient(triton)
    for model in exported["repository"].models:
        assert client.is_model_ready(model.name), model.name
        got = _infer(triton, model.name, x.numpy())
        # The config's names: the export's, except OpenVINO's IR, which names outputs after their operation.
        assert list(got) == [t.name for t in model.outputs], model.name
        assert [model.export_names.get(t.name, t.name) for t in model.outputs] == ["output_0", "output_1"]
        for out, want, ref in zip(got.values(), saved.expected, reference):
            assert out.dtype == np.float32 and out.shape == tuple(want.shape), (model.name, out.shape)
            assert rel_err(torch.tensor(out), want) < EXPORT_RTOL, model.name
            assert rel_err(torch.tensor(out), ref) < EXPORT_RTOL, model.name


def test_serve_answers_the_same_requests_with_the_same_outputs_and_metadata(
        triton: str, served: str, exported: Dict[str, Any]) -> None:
    x = np.random.default_rng(1).standard_normal((5, 3, 12, 12)).astype(np.float32)
    name = exported["repository"].models[0].name
    assert name == exported["dir"].name  # the selection's model: named as fx-lightning serve names it
    ours, theirs = _infer(served, name, x), _infer(triton, name, x)
    assert list(ours) == list(theirs)
    for a, b in zip(ours.values(), theirs.values()):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(torch.tensor(a), torch.tensor(b)) < 1e-6  # both run the selected artifact
    ours_meta = http.InferenceServerClient(served).get_model_metadata(name)
    theirs_meta = http.InferenceServerClient(triton).get_model_metadata(name)
    for key in ("name", "versions", "inputs", "outputs"):
        assert ours_meta[key] == theirs_meta[key], key
    # Height and width were shown to vary (trace.probe_sizes): any size, on both servers.
    assert ours_meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3, -1, -1]}]
    y = np.random.default_rng(2).standard_normal((2, 3, 16, 20)).astype(np.float32)
    for a, b in zip(_infer(served, name, y).values(), _infer(triton, name, y).values()):
        assert a.shape == b.shape and rel_err(torch.tensor(a), torch.tensor(b)) < 1e-6


def _perf(engines: Engines, url: str, model: str, out: Path) -> List[Dict[str, str]]:
    # Sizes that vary are -1 in the metadata: perf_analyzer, as with Triton, is told the ones to send.
    run = engines.run_perf_analyzer(model, url, out, concurrency=2, requests=40, extra=["--shape", "x:3,12,12"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "error" not in run.stdout.lower(), run.stdout[-3000:]
    with open(out) as handle:
        return list(csv.DictReader(handle))


def test_perf_analyzer_runs_against_both_without_an_error(engines: Engines, triton: str, served: str,
                                                          exported: Dict[str, Any]) -> None:
    name = exported["dir"].name
    for url, label in ((served, "serve"), (triton, "triton")):
        rows = _perf(engines, url, name, exported["tmp"] / f"perf-{label}.csv")
        assert len(rows) == 1 and float(rows[0]["Inferences/Second"]) > 0, rows
        assert float(rows[0]["p99 latency"]) >= float(rows[0]["p50 latency"]) > 0, rows
    stats = json.loads(urllib.request.urlopen(f"http://{served}/v2/models/{name}/stats").read())
    inference = stats["model_stats"][0]["inference_stats"]
    assert inference["success"]["count"] > 0 and inference["fail"]["count"] == 0
    assert inference["compute_infer"]["ns"] > 0
    assert 0 < stats["model_stats"][0]["execution_count"] <= inference["success"]["count"]
    # tritonclient's statistics of every model (no name): the path /v2/models/stats
    assert http.InferenceServerClient(served).get_inference_statistics()["model_stats"][0]["name"] == name


@pytest.mark.parametrize("shape", [[2, 4, 12, 12], [2, 3, 12]])
def test_a_bad_request_gets_a_4xx_naming_the_problem_from_each(triton: str, served: str,
                                                               exported: Dict[str, Any], shape: List[int]) -> None:
    name = exported["dir"].name
    x = np.zeros(shape, dtype=np.float32)
    for url in (served, triton):
        client = http.InferenceServerClient(url)
        given = http.InferInput("x", shape, "FP32")
        given.set_data_from_numpy(x)
        with pytest.raises(Exception) as info:
            client.infer(name, [given])
        assert "400" in str(info.value.status()) or str(info.value.status()).startswith("4"), str(info.value)
        assert "x" in str(info.value) and "shape" in str(info.value).lower(), str(info.value)
    # fx-lightning serve names what it takes
    with pytest.raises(Exception) as info:
        given = http.InferInput("x", shape, "FP32")
        given.set_data_from_numpy(x)
        http.InferenceServerClient(served).infer(name, [given])
    assert "[-1, 3, -1, -1]" in str(info.value)
