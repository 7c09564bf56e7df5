"""``fx-lightning serve``: a fresh server process (clean environment, outside the repository, so it cannot see the
training code) answers with the artifact's outputs, keeps each request's rows apart under concurrent batched load,
refuses each bad request with a 4xx naming the problem and keeps serving, and reports 503 on ``/health`` for an
artifact that fails its sha256."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from export_helpers import clean_env, free_port
from fusion_helpers import reference_fp64, rel_err
from lightning_helpers import TwoHeads
from fx_lightning import FuseConfig, fuse_and_export, load_fused
from fx_lightning.config.schema import ExportFormat
from fx_lightning.export.check import read_check_file

pytest.importorskip("litserve")

STARTUP_S = 120.0


def _export(model: nn.Module, directory: Path, formats: List[ExportFormat]) -> Path:
    cfg = FuseConfig()
    cfg.export.formats = formats
    g = torch.Generator().manual_seed(0)
    fuse_and_export(model, directory, batches=[torch.randn(6, 3, 12, 12, generator=g) for _ in range(2)], config=cfg)
    return directory


@contextlib.contextmanager
def running_server(directory: Path, cwd: Path, *flags: str, wait_ready: bool = True) -> Iterator[str]:
    """``python -I -m fx_lightning serve directory`` on a free port, in ``cwd``; yields its base URL."""
    port = free_port()
    log = open(cwd / f"server-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-I", "-m", "fx_lightning", "serve", str(directory), "--port", str(port),
                             *flags], cwd=cwd, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"server exited ({proc.returncode}):\n{(cwd / log.name).read_text()}"
            status, _ = get(f"{url}/health")
            if status == 200 or (status == 503 and not wait_ready):
                break
            assert time.monotonic() < deadline, f"no answer within {STARTUP_S} s:\n{Path(log.name).read_text()}"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()  # the server shuts its HTTP and worker processes down on SIGTERM
        try:  # LitServe gives open connections up to 30 s, then each worker 5 s
            proc.wait(timeout=75)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 15  # multiprocessing's resource tracker exits just after the server
        while (leftovers := _group_alive(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert not leftovers, f"processes left running after SIGTERM: {leftovers}"


def _group_alive(group: int) -> List[str]:
    """Processes of the server's session still running (after its main process exited): pid and command."""
    found = subprocess.run(["ps", "-o", "pid=,stat=,args=", "--sid", str(group)], capture_output=True,
                           text=True).stdout
    return [line.strip()[:160] for line in found.splitlines() if line.split() and "Z" not in line.split()[1]]


def get(url: str) -> Tuple[Optional[int], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None, b""


def post(url: str, body: bytes, content_type: Optional[str], accept: Optional[str] = None) -> Tuple[int, bytes]:
    headers = {k: v for k, v in (("Content-Type", content_type), ("Accept", accept)) if v}
    request = urllib.request.Request(f"{url}/predict", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def as_json(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [x.tolist()]}).encode()


def as_npy(x: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, x)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    """A two-output model exported as pt2 and ONNX, served with batching (a batch: what waits when the worker is
    free) and a 1 MiB body limit."""
    tmp = tmp_path_factory.mktemp("served")
    torch.manual_seed(0)
    model = TwoHeads().eval()
    directory = _export(model, tmp / "export", [ExportFormat.pt2, ExportFormat.onnx])
    with running_server(directory, tmp, "--max-batch-size", "4", "--batch-timeout", "0", "--max-body-mb", "1",
                        "--max-request-batch", "16") as url:
        yield {"url": url, "model": model, "dir": directory}


def _outputs(body: bytes) -> List[torch.Tensor]:
    data = json.loads(body)
    return [torch.tensor(o) for o in data["outputs"]]


def test_fresh_server_answers_like_the_artifact_on_check_inputs(served: Dict[str, Any]) -> None:
    saved = read_check_file(served["dir"])
    assert saved is not None
    x = saved.inputs[0]
    artifact = load_fused(served["dir"])
    with torch.no_grad():
        local = [t for t in artifact(x)]
    expected = saved.expected  # fp64 outputs saved at export
    reference = reference_fp64(served["model"], x)
    for body, content_type in ((as_json(x.numpy()), "application/json"), (as_npy(x.numpy()), "application/x-npy")):
        status, answer = post(served["url"], body, content_type)
        assert status == 200, answer
        data = json.loads(answer)
        assert data["output_names"] == ["output_0", "output_1"]
        got = _outputs(answer)
        assert [tuple(t.shape) for t in got] == [(x.shape[0], 5), (x.shape[0], 8)]
        for out, mine, want, ref in zip(got, local, expected, reference):
            assert rel_err(out, mine) < 1e-6  # the server runs the artifact itself
            assert rel_err(out, want) < 1e-5  # within the export's tolerance of the saved fp64 outputs
            assert rel_err(out, ref) < 1e-5  # and of the original model in fp64
    # One sample without its batch axis comes back without one.
    status, answer = post(served["url"], as_json(x[0].numpy()), "application/json")
    assert status == 200
    got = _outputs(answer)
    assert [tuple(t.shape) for t in got] == [(5,), (8,)]
    assert rel_err(got[0], reference[0][0]) < 1e-5


def test_npz_answer_on_request(served: Dict[str, Any]) -> None:
    x = torch.randn(3, 3, 12, 12)
    status, answer = post(served["url"], as_npy(x.numpy()), "application/x-npy", accept="application/x-npz")
    assert status == 200
    with np.load(io.BytesIO(answer), allow_pickle=False) as npz:
        assert sorted(npz.keys()) == ["output_0", "output_1"]
        scores = torch.from_numpy(npz["output_0"])
    assert scores.dtype == torch.float32
    assert rel_err(scores, reference_fp64(served["model"], x)[0]) < 1e-5


def test_200_concurrent_requests_are_answered_each_with_its_own_rows(served: Dict[str, Any]) -> None:
    """200 requests at concurrency 8 of different batch sizes, batched by the server: no error, and each answer
    is that request's own rows (a batching bug would hand one request's rows to another)."""
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1 + i % 3, 3, 12, 12, generator=g) for i in range(200)]
    reference = [reference_fp64(served["model"], x)[0] for x in inputs]

    def one(i: int) -> Tuple[int, float]:
        body, content_type = ((as_json(inputs[i].numpy()), "application/json") if i % 2 else
                              (as_npy(inputs[i].numpy()), "application/x-npy"))
        status, answer = post(served["url"], body, content_type)
        return status, rel_err(_outputs(answer)[0], reference[i]) if status == 200 else float("inf")

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, range(200)))
    errors = [(i, s) for i, (s, _) in enumerate(results) if s != 200]
    assert errors == []
    assert max(e for _, e in results) < 1e-5


def _nan_json() -> bytes:
    x = np.zeros((1, 3, 12, 12), dtype=np.float32).tolist()
    x[0][1][2][3] = float("nan")
    return json.dumps({"inputs": [x]}).encode()  # Python writes NaN, which JSON parsers accept


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _npy_header(shape: Tuple[int, ...]) -> bytes:
    """An .npy header declaring ``shape`` and almost no data: reading it must not allocate the array."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buffer.getvalue() + b"\0" * 64


def _corrupt_npz() -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, x=np.ones((2, 3, 12, 12), np.float32))
    data = bytearray(buffer.getvalue())
    data[len(data) // 3] ^= 0xFF
    return bytes(data)


GOOD = np.random.default_rng(0).standard_normal((2, 3, 12, 12)).astype(np.float32)

# (name, body, content type, expected status, words the message must hold)
BAD_REQUESTS = [
    # Height and width were shown to vary (trace.probe_sizes): the channels are what is fixed.
    ("wrong shape", as_json(GOOD[:, :2]), "application/json", 422, ["expected shape [batch, 3, any, any]",
                                                                   "[2, 2, 12, 12]"]),
    ("wrong rank", as_json(GOOD[0, 0]), "application/json", 422, ["expected rank 4", "got rank 2"]),
    ("wrong dtype", as_npy(GOOD.astype(np.float64)), "application/x-npy", 422, ["expected dtype float32",
                                                                               "float64"]),
    ("strings", json.dumps({"inputs": [[["a"]]]}).encode(), "application/json", 422, ["expected numbers"]),
    ("ragged list", json.dumps({"inputs": [[[1.0], [1.0, 2.0]]]}).encode(), "application/json", 422, ["ragged"]),
    ("no inputs key", b'{"x": 1}', "application/json", 422, ["inputs"]),
    ("two arrays for one input", json.dumps({"inputs": [GOOD.tolist(), GOOD.tolist()]}).encode(),
     "application/json", 422, ["expected 1 array", "got 2"]),
    ("unknown input name", json.dumps({"inputs": {"pixels": GOOD.tolist()}}).encode(), "application/json", 422,
     ["unknown ['pixels']"]),
    ("empty body", b"", "application/json", 400, ["empty body"]),
    ("NaN", _nan_json(), "application/json", 422, ["NaN", "finite float32"]),
    ("oversized payload", b"[" + b"0," * (600 << 10) + b"0]", "application/json", 413, ["exceeds the limit"]),
    ("too many samples", as_npy(np.zeros((17, 3, 12, 12), np.float32)), "application/x-npy", 413,
     ["[17, 3, 12, 12]", "limit of 16 samples"]),
    ("malformed JSON", b'{"inputs": [[1, 2', "application/json", 400, ["malformed JSON"]),
    ("malformed npy", b"\x93NUMPY garbage", "application/x-npy", 400, ["malformed application/x-npy"]),
    ("wrong content type", b"hello", "text/plain", 415, ["'text/plain'", "application/json"]),
    ("no content type", as_json(GOOD), None, 415, ["application/json"]),
    ("image without an image contract", _png(12, 12), "image/png", 415, ["no image contract"]),
    ("negative top_k", json.dumps({"inputs": [GOOD.tolist()], "top_k": -1}).encode(), "application/json", 422,
     ["top_k"]),
    ("infinite top_k", b'{"inputs": [[[[[0]]]]], "top_k": 1e999}', "application/json", 422, ["top_k", "inf"]),
    ("deeply nested JSON", b"[" * 100000, "application/json", 400, ["nested too deeply"]),
    ("booleans for a float input", json.dumps({"inputs": [np.ones((1, 3, 12, 12), bool).tolist()]}).encode(),
     "application/json", 422, ["expected numbers (float32)", "true/false"]),
    ("beyond float32", json.dumps({"inputs": [np.full((1, 3, 12, 12), 1e39).tolist()]}).encode(),
     "application/json", 422, ["out of float32's range"]),
    ("a huge array declared in the npy header", _npy_header((1 << 40, 3, 12, 12)), "application/x-npy", 413,
     ["exceeds the limit of 16 samples"]),
    ("corrupt npz", _corrupt_npz(), "application/x-npz", 400, ["malformed application/x-npz"]),
]


@pytest.mark.parametrize("name,body,content_type,status,words", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving(
        served: Dict[str, Any], name: str, body: bytes, content_type: Optional[str], status: int,
        words: List[str]) -> None:
    got, answer = post(served["url"], body, content_type)
    assert got == status, answer
    message = json.loads(answer)["error"]
    for word in words:
        assert word in message, message
    good, answer = post(served["url"], as_npy(GOOD), "application/x-npy")
    assert good == 200, answer
    assert rel_err(_outputs(answer)[0], reference_fp64(served["model"], torch.from_numpy(GOOD))[0]) < 1e-5


def test_info_shows_the_contract_and_the_artifact(served: Dict[str, Any]) -> None:
    status, body = get(f"{served['url']}/info")
    assert status == 200
    model = json.loads(body)["model"]
    assert model["artifact"]["name"] == "pt2"
    assert model["contract"]["inputs"] == [{"name": model["contract"]["inputs"][0]["name"], "dtype": "float32",
                                            "shape": ["batch", 3, None, None]}]
    assert [o["name"] for o in model["contract"]["outputs"]] == ["output_0", "output_1"]
    assert model["parity"]["passed"] is True
    assert model["versions"]["torch"] == torch.__version__
    status, body = get(f"{served['url']}/health")
    assert status == 200 and json.loads(body)["workers"][0]["relative_error"] < 1e-5


def test_health_is_503_with_the_reason_for_a_corrupted_artifact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    directory = _export(TwoHeads().eval(), tmp_path / "export", [ExportFormat.pt2])
    artifact = directory / "model.pt2"
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data))
    with running_server(directory, tmp_path, wait_ready=False) as url:
        deadline = time.monotonic() + STARTUP_S
        while True:  # 503 while loading, then 503 with the sha256 failure
            status, body = get(f"{url}/health")
            assert status == 503, body
            reason = json.loads(body).get("reason", "")
            if "sha256" in reason or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert "model.pt2" in reason and "sha256" in reason, reason
        status, answer = post(url, as_npy(GOOD), "application/x-npy")
        assert status == 503 and "sha256" in json.loads(answer)["error"]


def test_bad_options_are_refused_before_any_process_starts(tmp_path: Path) -> None:
    from fx_lightning import ConfigError, ExportError
    from fx_lightning.serve.server import ServeOptions, build_server

    with pytest.raises(ConfigError, match="max_batch_size: 0; allowed: an integer >= 1"):
        build_server(tmp_path, ServeOptions(max_batch_size=0))
    with pytest.raises(ExportError, match="no such export directory"):
        build_server(tmp_path / "missing")
    torch.manual_seed(0)
    directory = _export(TwoHeads().eval(), tmp_path / "export", [ExportFormat.pt2])
    with pytest.raises(ExportError, match="format 'onnx' was not exported"):
        build_server(directory, ServeOptions(format="onnx"))
    shutil.rmtree(directory)


# --------------------------------------------------------------------------- raw pixels (export.preprocess)

MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]


def _normalised(raw_nhwc: torch.Tensor) -> torch.Tensor:
    """The training-time normalisation, written here independently of the export's prologue, in fp64."""
    x = raw_nhwc.permute(0, 3, 1, 2).double() / 255.0
    return (x - torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(
        STD, dtype=torch.float64).view(1, 3, 1, 1)


@pytest.fixture(scope="module")
def served_pixels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    """A classifier exported with the normalisation compiled in (uint8 NHWC pixels) and class names."""
    tmp = tmp_path_factory.mktemp("pixels")
    torch.manual_seed(0)
    model = TwoHeads().eval()
    cfg = FuseConfig()
    cfg.export.formats = [ExportFormat.pt2]
    cfg.export.preprocess.enabled = True
    cfg.export.preprocess.mean, cfg.export.preprocess.std = MEAN, STD
    cfg.export.preprocess.layout = type(cfg.export.preprocess.layout)["NHWC"]
    cfg.export.labels = ["ant", "bee", "cat", "dog", "eel"]
    g = torch.Generator().manual_seed(2)
    raw = [torch.randint(0, 256, (6, 12, 12, 3), generator=g, dtype=torch.uint8) for _ in range(2)]
    fuse_and_export(model, tmp / "export", batches=[_normalised(r).float() for r in raw], config=cfg)
    with running_server(tmp / "export", tmp) as url:
        yield {"url": url, "model": model, "dir": tmp / "export"}


def test_raw_pixel_requests_answer_as_the_training_normalisation_path(served_pixels: Dict[str, Any]) -> None:
    from PIL import Image

    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (4, 12, 12, 3), generator=g, dtype=torch.uint8)
    reference = reference_fp64(served_pixels["model"], _normalised(raw))  # fp64 model on fp64-normalised pixels
    status, answer = post(served_pixels["url"], as_npy(raw.numpy()), "application/x-npy")
    assert status == 200, answer
    got = _outputs(answer)
    assert [tuple(t.shape) for t in got] == [(4, 5), (4, 8)]
    for out, ref in zip(got, reference):
        assert rel_err(out, ref) < 1e-5
    labels = ["ant", "bee", "cat", "dog", "eel"]
    for i in range(2):  # the same pixels as a PNG: one sample, its top-k named
        buffer = io.BytesIO()
        Image.fromarray(raw[i].numpy(), "RGB").save(buffer, format="PNG")
        status, answer = post(served_pixels["url"], buffer.getvalue(), "image/png")
        assert status == 200, answer
        data = json.loads(answer)
        assert rel_err(torch.tensor(data["outputs"][0]), reference[0][i]) < 1e-5
        best = int(reference[0][i].argmax())
        assert data["top_k"][0]["label"] == labels[best] and len(data["top_k"]) == 5
    # An image of another size (height and width were shown to vary): answered as the model answers it.
    other = torch.randint(0, 256, (1, 16, 20, 3), generator=g, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(other[0].numpy(), "RGB").save(buffer, format="PNG")
    status, answer = post(served_pixels["url"], buffer.getvalue(), "image/png")
    assert status == 200, answer
    want = reference_fp64(served_pixels["model"], _normalised(other))[0][0]
    assert rel_err(torch.tensor(json.loads(answer)["outputs"][0]), want) < 1e-5
    status, answer = post(served_pixels["url"], _png(4000, 4000), "image/png")  # more pixels than a body may hold
    assert status == 413 and "4000x4000" in json.loads(answer)["error"], answer
    status, answer = post(served_pixels["url"], as_npy(raw.numpy().astype(np.float32)), "application/x-npy")
    assert status == 422 and "uint8" in json.loads(answer)["error"]
    status, body = get(f"{served_pixels['url']}/info")
    contract = json.loads(body)["model"]["contract"]
    assert contract["inputs"][0]["dtype"] == "uint8" and contract["inputs"][0]["shape"] == ["batch", None, None, 3]
    assert contract["preprocess"]["mean"] == MEAN
    assert contract["image"] == {"height": None, "width": None, "channels": 3}


def test_a_worker_runs_few_batch_sizes_each_warmed_once() -> None:
    """OpenVINO and Inductor compile per shape (OpenVINO keeps a few): the worker runs a dynamic-batch artifact
    only at 1, 2, 4... up to --max-batch-size, any batch as pieces of those, each warmed before it is ready."""
    from fx_lightning.formats.batching import BatchPieces
    from fx_lightning.serve.artifact import serving_batch_sizes, warm_up

    assert serving_batch_sizes(None, 8) == [1, 2, 4, 8]
    assert serving_batch_sizes(None, 12) == [1, 2, 4, 8, 12]
    assert serving_batch_sizes(None, 1) == [1]
    assert serving_batch_sizes([1, 8], 16) == [1, 8]  # an artifact built for sizes runs those
    seen: List[int] = []

    class Recorder(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.shape[0])
            return x * 2

    sizes = serving_batch_sizes(None, 8)
    served = BatchPieces({str(size): Recorder() for size in sizes}, [0], [0], warn=False)
    warm_up(served, [torch.zeros(3, 2)], sizes, [0])
    assert seen == [1, 2, 4, 8]
    seen.clear()
    x = torch.arange(26.0).view(13, 2)
    assert torch.equal(served(x), x * 2)  # rows in order
    assert seen == [8, 4, 1]


class RecordingQueue:
    """A request queue that records how it was read: ``("wait", timeout)`` for a blocking get, ``"nowait"``."""

    def __init__(self, items: List[Any]) -> None:
        self.items, self.reads = list(items), []  # type: ignore[var-annotated]

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        import queue

        self.reads.append(("wait", timeout))
        if not self.items:
            raise queue.Empty
        return self.items.pop(0)

    def get_nowait(self) -> Any:
        import queue

        self.reads.append("nowait")
        if not self.items:
            raise queue.Empty
        return self.items.pop(0)


@pytest.mark.parametrize("queued, max_batch, expected", [(0, 4, 0), (1, 4, 1), (3, 4, 3), (6, 4, 4)])
def test_batch_timeout_0_runs_what_waits_and_an_idle_worker_blocks(queued: int, max_batch: int,
                                                                   expected: int) -> None:
    """--batch-timeout 0 (Triton's queue delay 0): a batch is the first request to come and whatever else waits
    then, up to the largest batch, no request waiting for company; an empty queue is waited on, not polled (LitServe's
    own timeout-0 collection reads it with get_nowait in a loop without pause: a core spent idle)."""
    from types import SimpleNamespace

    from fx_lightning.serve.app import IDLE_WAKE_S, GreedyBatchedLoop

    requests = [(0, f"uid{i}", time.monotonic(), f"x{i}") for i in range(queued)]
    waiting = RecordingQueue(requests)
    api = SimpleNamespace(batch_timeout=0.0, max_batch_size=max_batch, request_timeout=30.0, stream=False)
    batch, timed_out = GreedyBatchedLoop().get_batch_requests(api, waiting, None)
    assert [uid for _, uid, _ in batch] == [f"uid{i}" for i in range(expected)] and timed_out == []
    assert waiting.reads[0] == ("wait", IDLE_WAKE_S)  # the first read blocks
    assert all(r == "nowait" for r in waiting.reads[1:])  # the rest take only what is there
    assert len(waiting.items) == queued - expected


def test_small_decoding_and_encoding_run_on_the_event_loop_large_in_a_thread() -> None:
    """A thread handoff costs more CPU than decoding a small body or encoding a top-k answer (docs/performance.md):
    those run on the event loop; work beyond LOOP_WORK_BYTES (a large body, an image's pixels, a large answer)
    goes to a thread so it does not hold up the other requests. An image's work is its pixels, not its compressed
    body: a flat 224x224 PNG is a few hundred bytes and 150528 bytes of pixels to decode."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from fx_lightning.serve.app import LOOP_WORK_BYTES, answer_work, decode_work, on_loop_if_small

    async def threads_for(works: List[int]) -> Tuple[int, List[int]]:
        ran = [await on_loop_if_small(w, threading.get_ident) for w in works]
        return threading.get_ident(), ran

    loop_thread, ran = asyncio.run(threads_for([0, LOOP_WORK_BYTES, LOOP_WORK_BYTES + 1, 10 * LOOP_WORK_BYTES]))
    assert ran[:2] == [loop_thread, loop_thread]
    assert ran[2] != loop_thread and ran[3] != loop_thread

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (224, 224)).save(buffer, format="PNG")
    png = buffer.getvalue()
    images = SimpleNamespace(image_size=(224, 224, 3))
    assert len(png) < LOOP_WORK_BYTES < decode_work(png, "image/png", images) == 224 * 224 * 3
    assert decode_work(png, "image/png; charset=binary", SimpleNamespace(image_size=(8, 8, 3))) == len(png)
    body = json.dumps({"inputs": [[0.5] * 40] * 100}).encode()
    assert decode_work(body, "application/json", images) == len(body) > LOOP_WORK_BYTES
    scores = [np.zeros((1, 10), np.float32)]
    assert answer_work(scores) == 200 and answer_work(scores, npz=True) == 40
    assert answer_work([np.zeros((1, 64, 64), np.float32)]) > LOOP_WORK_BYTES  # a 64x64 map as JSON: a thread


def test_health_reports_the_warm_up(served: Dict[str, Any]) -> None:
    status, body = get(f"{served['url']}/health")
    worker = json.loads(body)["workers"][0]
    assert status == 200 and worker["warmup_s"] > 0 and worker["artifact"] == "pt2"


def test_a_failed_run_reports_the_exception_readably() -> None:
    import pickle

    from fx_lightning.serve.app import worker_error

    assert worker_error(pickle.dumps(IndexError("index 7 is out of bounds"))) == (
        500, "inference failed: IndexError: index 7 is out of bounds")
    assert worker_error(b"not a pickle")[0] == 500 and "byte error report" in worker_error(b"not a pickle")[1]


def test_self_check_needs_the_check_file_the_manifest_lists(served: Dict[str, Any], tmp_path: Path) -> None:
    """A deleted or swapped check.pt must not let a worker report ready unchecked."""
    from fx_lightning import ExportError
    from fx_lightning.serve.artifact import ServeOptions, load_checked

    directory = tmp_path / "copy"
    shutil.copytree(served["dir"], directory)
    _, status = load_checked(directory, ServeOptions())
    assert status.ready and status.relative_error is not None and status.relative_error < 1e-5
    saved = torch.load(directory / "check.pt", weights_only=True)
    saved["expected"] = [t * 2 for t in saved["expected"]]  # outputs that would fail the artifact
    torch.save(saved, directory / "check.pt")
    with pytest.raises(ExportError, match="check.pt: corrupt file: sha256"):
        load_checked(directory, ServeOptions())
    (directory / "check.pt").unlink()
    with pytest.raises(ExportError, match="check.pt"):
        load_checked(directory, ServeOptions())


def test_two_workers_each_self_check_and_share_the_load(served: Dict[str, Any], tmp_path: Path) -> None:
    """--workers 2: /health waits for both workers' self-checks, and concurrent requests are all answered right."""
    with running_server(served["dir"], tmp_path, "--workers", "2", "--threads", "1", "--max-batch-size", "2") as url:
        status, body = get(f"{url}/health")
        workers = json.loads(body)["workers"]
        assert status == 200 and len(workers) == 2 and all(w["ready"] and w["relative_error"] < 1e-5
                                                           for w in workers)
        g = torch.Generator().manual_seed(5)
        inputs = [torch.randn(2, 3, 12, 12, generator=g) for _ in range(24)]

        def one(x: torch.Tensor) -> float:
            code, answer = post(url, as_npy(x.numpy()), "application/x-npy")
            assert code == 200, answer
            return rel_err(_outputs(answer)[0], reference_fp64(served["model"], x)[0])

        with ThreadPoolExecutor(max_workers=6) as pool:
            assert max(pool.map(one, inputs)) < 1e-5


class MeanOverTime(nn.Module):
    """[batch, time, features] -> scores: the time length varies from batch to batch."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.bn, self.head = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.proj(x).mean(1))))


def test_batched_requests_whose_sizes_vary_off_the_sample_axis_run_in_groups_of_one_shape(tmp_path: Path) -> None:
    """Requests of 5 and 7 time steps in one batch: before, their inputs were concatenated into one tensor, which
    raised, and every request of the batch failed. Now each shape runs as its own group, each request gets its rows."""
    from fx_lightning.export.manifest import read_manifest
    from fx_lightning.serve.app import ArtifactAPI
    from fx_lightning.serve.contract import Contract, Decoded

    torch.manual_seed(0)
    model = MeanOverTime().eval()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, t, 4, generator=g) for n, t in ((6, 5), (6, 9), (4, 7))]
    cfg = FuseConfig()
    cfg.export.formats = [ExportFormat.pt2]
    fuse_and_export(model, tmp_path / "e", batches=batches, config=cfg)
    contract = Contract.of(read_manifest(tmp_path / "e"))
    assert contract.batched and contract.request_sizes(contract.inputs[0]) == (None, 4)
    api = object.__new__(ArtifactAPI)  # the worker's batch and predict, without a server around them
    api.model = load_fused(tmp_path / "e")
    requests = [torch.randn(n, t, 4, generator=g) for n, t in ((2, 5), (1, 7), (3, 5), (1, 11))]
    batch = ArtifactAPI.batch(api, [Decoded([x.numpy()]) for x in requests])
    assert sorted(len(places) for _, _, places in batch.groups) == [1, 1, 2]
    answers = ArtifactAPI.predict(api, batch)
    assert len(answers) == len(requests)
    for x, answer in zip(requests, answers):
        want = reference_fp64(model, x)
        assert len(answer.outputs) == 1 and answer.outputs[0].shape == (x.shape[0], 3)
        assert rel_err(torch.from_numpy(answer.outputs[0]), want) < 1e-5
        assert answer.ns > 0  # the run's time, for the Open Inference Protocol's statistics
