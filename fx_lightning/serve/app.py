"""The LitServe side of :mod:`fx_lightning.serve.server`: the worker's LitAPI (load and self-check the artifact,
batch, run, split) and the HTTP side's LitSpec (read the body within its limit, decode it against the contract,
answer 4xx for what does not fit, encode the outputs), for ``/predict`` and for the Open Inference Protocol's
``/v2`` endpoints (:mod:`fx_lightning.serve.oip`). Module-level classes: LitServe pickles the LitAPI into each
worker process. Imported only when a server is built (``litserve`` is an optional extra)."""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
import pickle
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import litserve as ls
import numpy as np
import torch
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from litserve.loops import BatchedLoop
from litserve.specs.base import LitSpec
from litserve.utils import LitAPIStatus, ResponseBufferItem

from fx_lightning.common.batches import flat_tensors
from fx_lightning.errors import first_line
from fx_lightning.common.rows import same_shape_groups, split_rows
from fx_lightning.serve import oip
from fx_lightning.export.manifest import read_manifest
from fx_lightning.serve.artifact import WorkerStatus, ServeOptions, StatusBoard, load_checked
from fx_lightning.serve.contract import IMAGE_TYPES, NPZ_TYPE, BadRequest, Contract, Decoded, top_k_labels
from fx_lightning.serve.triton_config import TritonModel, config_json

__all__ = ["ArtifactAPI", "ContractSpec", "GreedyBatchedLoop", "Ran", "make_server", "decode_work", "answer_work",
           "on_loop_if_small"]

# How long an idle worker blocks on its queue before it looks again (LitServe's own loops stop on a sentinel they
# read from the queue, so the wait only bounds how often an idle worker wakes).
IDLE_WAKE_S = 1.0
# A request's decoding and its answer's encoding run on the event loop up to this much work (bytes read: the body,
# an image's pixels; or written: the answer), else in a thread, so that a large one does not hold up /health and
# the other requests' I/O. A thread handoff costs about 0.1 ms of CPU each way, more than such work: 16 KiB is about
# 0.4 ms of JSON and 0.1 ms of PNG here (figures: docs/performance.md).
LOOP_WORK_BYTES = 16 * 1024
# About what json.dumps writes for a float and its separator: a JSON answer's work per value.
JSON_BYTES_PER_VALUE = 20


@dataclass
class Ran:
    """A request's outputs as the worker sends them back, with how long the run that made them took (the whole
    batch's run when it was batched): the statistics' compute time."""

    outputs: List[np.ndarray]
    ns: int
    requests_in_run: int = 1

@dataclass
class Batched:
    """Requests batched along the sample axis: one group per shape of their inputs beyond it (requests whose
    sizes vary elsewhere, a sequence length say, cannot share a tensor), each with the joined inputs, its requests'
    sample counts and their places in the batch."""

    groups: List[Tuple[List[torch.Tensor], List[int], List[int]]]
    count: int


class FirstWaits:
    """A request queue whose first ``get_nowait`` blocks (up to ``wait_s``, then ``queue.Empty``) and the rest do
    not: handed to LitServe's collection of a batch with ``batch_timeout`` 0, the batch is the first request to
    come and whatever else waits by then."""

    def __init__(self, queue: Any, wait_s: float) -> None:
        self.queue, self.wait_s, self.first = queue, wait_s, True

    def get_nowait(self) -> Any:
        if self.first:
            self.first = False
            return self.queue.get(timeout=self.wait_s)
        return self.queue.get_nowait()


class GreedyBatchedLoop(BatchedLoop):
    """LitServe's batched loop, with ``batch_timeout`` 0 meaning what Triton's ``max_queue_delay_microseconds: 0``
    means: a batch is what waits when the worker is free, no request waits for company, and a worker with nothing
    to do blocks on its queue (LitServe's own timeout-0 collection polls it without pause, a core spent idle)."""

    def get_batch_requests(self, lit_api: Any, request_queue: Any, transport: Any) -> Tuple[list, list]:
        if lit_api.batch_timeout == 0:
            request_queue = FirstWaits(request_queue, IDLE_WAKE_S)
        return super().get_batch_requests(lit_api, request_queue, transport)


class ArtifactAPI(ls.LitAPI):
    """The worker: loads the artifact and checks it in ``setup`` (the result goes to the status board, which
    ``/health`` reads), then runs batches of decoded requests."""

    input_dtypes: Sequence[str] = ()  # the manifest's, read in setup: bfloat16 ones are cast for the model

    def __init__(self, root: Path, options: ServeOptions, board: StatusBoard, spec: LitSpec) -> None:
        super().__init__(max_batch_size=options.max_batch_size, batch_timeout=options.batch_timeout, spec=spec,
                         loop=GreedyBatchedLoop() if options.max_batch_size > 1 else "auto")
        self.root, self.options, self.board = root, options, board
        self.model: Optional[torch.nn.Module] = None

    def setup(self, device: Any) -> None:
        torch.set_num_threads(self.options.threads_per_worker())
        worker = os.environ.get("LITSERVE_WORKER_ID", "0")
        try:
            self.input_dtypes = [leaf.dtype for leaf in read_manifest(self.root).call_signature().inputs]
            self.model, status = load_checked(self.root, self.options)
        except Exception as exc:  # noqa: BLE001 - reported by /health instead of stopping the server
            self.model, status = None, WorkerStatus(False, reason=f"{type(exc).__name__}: {first_line(exc)}")
        self.board.write(worker, status)

    def decode_request(self, request: Decoded, **kwargs: Any) -> Decoded:
        return request  # decoded and checked by the HTTP side

    def batch(self, inputs: List[Decoded]) -> Batched:
        groups = []
        for places in same_shape_groups([d.arrays for d in inputs]):
            parts = list(zip(*(inputs[i].arrays for i in places)))
            joined = [torch.from_numpy(np.concatenate(p) if len(p) > 1 else p[0]) for p in parts]
            groups.append((joined, [inputs[i].batch_size for i in places], places))
        return Batched(groups, len(inputs))

    def predict(self, x: Union[Decoded, Batched]) -> Any:
        """One request's outputs (no batching), or each request's outputs of a batch."""
        if self.model is None:
            raise RuntimeError("the artifact failed its self-check (see /health)")
        if not isinstance(x, Batched):
            start = time.perf_counter_ns()
            outputs = self._run([torch.from_numpy(a) for a in x.arrays])
            return Ran(outputs, time.perf_counter_ns() - start)
        answers: List[Any] = [None] * x.count
        for args, sizes, places in x.groups:
            start = time.perf_counter_ns()
            outputs = self._run(args)
            took = time.perf_counter_ns() - start
            for place, rows in zip(places, split_rows(outputs, sizes)):
                answers[place] = Ran(rows, took, len(places))
        return answers

    def _run(self, args: List[torch.Tensor]) -> List[np.ndarray]:
        assert self.model is not None
        # bfloat16 travels as float32 (numpy has no bfloat16): cast in for the model, and out for numpy.
        dtypes = list(self.input_dtypes) + [""] * (len(args) - len(self.input_dtypes))
        args = [a.to(torch.bfloat16) if dtype == "bfloat16" else a for a, dtype in zip(args, dtypes)]
        with torch.no_grad():
            return [(t.float() if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()
                    for t in flat_tensors(self.model(*args))]

    def unbatch(self, output: List[Ran]) -> List[Ran]:
        return output

    def encode_response(self, output: Ran, **kwargs: Any) -> Ran:
        return output  # encoded by the HTTP side, which knows what the client accepts


class ContractSpec(LitSpec):
    """``POST /predict``, ``GET /health`` and the Open Inference Protocol's ``/v2`` endpoints on the HTTP side."""

    def __init__(self, contract: Contract, board: StatusBoard, top_k: int, model: Union[TritonModel, str],
                 platform: str) -> None:
        super().__init__()
        self.api_path = "/predict"
        self.contract, self.board, self.top_k = contract, board, top_k
        # The model as the protocol states it, or why it cannot (then /v2's model endpoints answer 501 saying so).
        self.model, self.unstated = (model, "") if isinstance(model, TritonModel) else (None, model)
        self.platform = platform
        self.stats = oip.Statistics()

    def pre_setup(self, lit_api: Any) -> None:
        self.add_endpoint("/predict", self.predict_endpoint, ["POST"])
        self.add_endpoint("/health", self.health_endpoint, ["GET"])
        self.add_endpoint("/v2", self.server_metadata, ["GET"])
        self.add_endpoint("/v2/health/live", self.live, ["GET"])
        self.add_endpoint("/v2/health/ready", self.server_ready, ["GET"])
        self.add_endpoint("/v2/models/stats", self.all_stats, ["GET"])  # before /v2/models/{model_name} matches it
        for base in ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{version}"):
            self.add_endpoint(base, self.model_metadata, ["GET"])
            self.add_endpoint(base + "/ready", self.model_ready, ["GET"])
            self.add_endpoint(base + "/config", self.model_config, ["GET"])
            self.add_endpoint(base + "/stats", self.model_stats, ["GET"])
            self.add_endpoint(base + "/infer", self.infer_endpoint, ["POST"])

    def decode_request(self, request: Any, context_kwargs: Optional[dict] = None) -> Any:
        return request

    def encode_response(self, output: Any, context_kwargs: Optional[dict] = None) -> Any:
        return output

    def not_ready(self) -> Tuple[bool, Dict[str, object]]:
        ready, statuses = self.board.read()
        body: Dict[str, object] = {"ready": ready, "workers": [s.to_dict() for s in statuses]}
        if not ready:
            failed = [s.reason for s in statuses if not s.ready]
            body["reason"] = failed[0] if failed else "loading the artifact"
        return not ready, body

    async def health_endpoint(self) -> Response:
        waiting, body = self.not_ready()
        return JSONResponse(body, status_code=503 if waiting else 200)

    async def run(self, decoded: Decoded) -> Tuple[Any, Any]:
        """The worker's answer to ``decoded``: (response, LitServe's status)."""
        uid = uuid.uuid4()
        event = asyncio.Event()
        self.response_buffer[uid] = ResponseBufferItem(event=event)
        self.request_queue.put_nowait((self.response_queue_id, uid, time.monotonic(), decoded))
        await event.wait()
        return self.response_buffer.pop(uid).response

    async def predict_endpoint(self, request: Request) -> Response:
        waiting, status = self.not_ready()
        if waiting:
            return error_response(503, f"not ready: {status['reason']}")
        try:
            body = await read_body(request, self.contract.max_body_bytes)
            content_type = request.headers.get("content-type", "")
            decoded = await on_loop_if_small(decode_work(body, content_type, self.contract), self.contract.decode,
                                             body, content_type, dict(request.query_params))
        except BadRequest as exc:
            return error_response(exc.status, exc.message)
        response, state = await self.run(decoded)
        if state == LitAPIStatus.ERROR:
            return error_response(*worker_error(response))
        npz = NPZ_TYPE in request.headers.get("accept", "")
        return await on_loop_if_small(answer_work(response.outputs, npz), encode_outputs, response.outputs, decoded,
                                      self.contract, self.top_k, npz=npz)

    # ------------------------------------------------------------------------- Open Inference Protocol (v2)

    def unknown(self, model_name: str, version: Optional[str]) -> Optional[Response]:
        """A 404 naming what is served, when the path names another model or version (501 when the protocol cannot
        state the model)."""
        if self.model is None:
            return error_response(501, self.unstated)
        if model_name != self.model.name:
            return error_response(404, f"unknown model {model_name!r}: this server serves {self.model.name!r}")
        if version not in (None, "", oip.MODEL_VERSION):
            return error_response(404, f"unknown version {version!r} of model {model_name!r}: it has version "
                                       f"{oip.MODEL_VERSION}")
        return None

    async def server_metadata(self) -> Response:
        return JSONResponse(oip.server_metadata())

    async def live(self) -> Response:
        return JSONResponse({"live": True})

    async def server_ready(self) -> Response:
        waiting, _ = self.not_ready()
        return JSONResponse({"ready": not waiting}, status_code=503 if waiting else 200)

    async def model_metadata(self, model_name: str, version: Optional[str] = None) -> Response:
        return self.unknown(model_name, version) or JSONResponse(oip.model_metadata(self.model, self.platform))

    async def model_ready(self, model_name: str, version: Optional[str] = None) -> Response:
        waiting, _ = self.not_ready()
        return self.unknown(model_name, version) or JSONResponse({"name": model_name, "ready": not waiting},
                                                                 status_code=503 if waiting else 200)

    async def model_config(self, model_name: str, version: Optional[str] = None) -> Response:
        return self.unknown(model_name, version) or JSONResponse(config_json(self.model))

    async def all_stats(self) -> Response:
        if self.model is None:
            return error_response(501, self.unstated)
        return JSONResponse(self.stats.to_dict(self.model.name))

    async def model_stats(self, model_name: str, version: Optional[str] = None) -> Response:
        return self.unknown(model_name, version) or JSONResponse(self.stats.to_dict(self.model.name))

    async def infer_endpoint(self, request: Request, model_name: str, version: Optional[str] = None) -> Response:
        refused = self.unknown(model_name, version)
        if refused is not None:
            return refused
        arrived = time.perf_counter_ns()
        waiting, status = self.not_ready()
        if waiting:
            return error_response(503, f"not ready: {status['reason']}")
        try:
            body = await read_body(request, self.contract.max_body_bytes)
            infer = await on_loop_if_small(len(body), oip.decode_infer, self.contract, self.model, body,
                                           request.headers.get(oip.BINARY_HEADER))
        except BadRequest as exc:
            self.stats.record_failure(time.perf_counter_ns() - arrived)
            return error_response(exc.status, exc.message)
        decoded_at = time.perf_counter_ns()
        response, state = await self.run(infer.decoded)
        ran_at = time.perf_counter_ns()
        if state == LitAPIStatus.ERROR:
            self.stats.record_failure(ran_at - arrived)
            return error_response(*worker_error(response))
        try:
            content, headers = await on_loop_if_small(answer_work(response.outputs), oip.encode_infer, self.model,
                                                      infer, response.outputs)
        except ValueError as exc:
            self.stats.record_failure(time.perf_counter_ns() - arrived)
            return error_response(500, f"inference failed: {exc}")
        done = time.perf_counter_ns()
        self.stats.record(total_ns=done - arrived, decode_ns=decoded_at - arrived, wait_ns=ran_at - decoded_at,
                          infer_ns=response.ns, encode_ns=done - ran_at,
                          samples=infer.decoded.batch_size if self.contract.batched else 1,
                          requests_in_run=response.requests_in_run)
        return Response(content, headers=headers, media_type=headers["content-type"])


def decode_work(body: bytes, content_type: str, contract: Contract) -> int:
    """The bytes decoding ``body`` handles: an image's pixels when the contract takes images (its compressed
    body says little of them), else the body itself."""
    media = content_type.split(";")[0].strip().lower()
    size = contract.image_size if media in IMAGE_TYPES else None
    # An image of any size: its compressed body is all there is to go by, so it is decoded off the loop.
    pixels = (LOOP_WORK_BYTES + 1 if None in size else math.prod(size)) if size is not None else 0  # type: ignore[arg-type]
    return max(len(body), pixels)


def answer_work(outputs: Sequence[np.ndarray], npz: bool = False) -> int:
    """The bytes encoding the answer writes: the outputs' own for an .npz, about ``JSON_BYTES_PER_VALUE`` per value
    for JSON."""
    return sum(int(o.nbytes) if npz else int(o.size) * JSON_BYTES_PER_VALUE for o in outputs)


async def on_loop_if_small(work: int, function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` on the event loop when ``work`` is at most ``LOOP_WORK_BYTES``, else in
    Starlette's thread pool."""
    if work <= LOOP_WORK_BYTES:
        return function(*args, **kwargs)
    return await run_in_threadpool(function, *args, **kwargs)


def make_server(root: Path, options: ServeOptions, contract: Contract, board: StatusBoard,
                info: Dict[str, object], model: Union[TritonModel, str], platform: str) -> ls.LitServer:
    api = ArtifactAPI(root, options, board, ContractSpec(contract, board, options.top_k, model, platform))
    # LitServe's own health check moves aside: it answers 200 once the worker started, ours once it checked.
    return ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=options.workers,
                        timeout=options.timeout, healthcheck_path="/litserve/health", model_metadata=info)


def worker_error(response: Any) -> Tuple[int, str]:
    """The status and message of a failed run: LitServe sends the worker's exception pickled (an HTTPException
    keeps its status; anything else is a 500 naming the exception)."""
    if isinstance(response, bytes):
        try:
            response = pickle.loads(response)
        except Exception:  # noqa: BLE001 - not a pickle: report the bytes' length, not their content
            return 500, f"inference failed ({len(response)}-byte error report)"
    status = int(getattr(response, "status_code", 500))
    detail = getattr(response, "detail", None)
    return status, str(detail) if detail else f"inference failed: {type(response).__name__}: {response}"


def error_response(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 when it passes ``limit`` (a client may send no Content-Length). What is over the
    limit is read and dropped, up to 4x the limit, so that the client gets the 413 rather than a connection reset
    while it is still sending; beyond that the connection is cut."""
    declared = request.headers.get("content-length", "")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > 4 * limit:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit or (declared.isdigit() and int(declared) > limit):
        raise BadRequest(413, f"body of {declared or 'over ' + str(limit)} bytes exceeds the limit of {limit} bytes "
                              "(--max-body-mb)")
    return b"".join(chunks)


def encode_outputs(outputs: List[np.ndarray], decoded: Decoded, contract: Contract, top_k: int, *,
                   npz: bool = False) -> Response:
    """JSON ``{"outputs": [...], "output_names": [...], "top_k": ...}`` (top-k when the export has labels and the
    first output is their scores), or an ``.npz`` of the outputs by name when the client accepts it."""
    if decoded.single:
        outputs = [o[0] if o.ndim else o for o in outputs]
    names = contract.output_names(len(outputs))
    if npz:
        buffer = io.BytesIO()
        np.savez(buffer, **dict(zip(names, outputs)))
        return Response(buffer.getvalue(), media_type=NPZ_TYPE)
    body: Dict[str, object] = {"outputs": [o.tolist() for o in outputs], "output_names": names}
    k = min(decoded.top_k if decoded.top_k is not None else top_k, len(contract.labels))
    scores = outputs[0] if outputs else None
    if k and scores is not None and scores.dtype.kind == "f" and scores.shape[-1:] == (len(contract.labels),):
        rows = top_k_labels(scores.reshape(-1, len(contract.labels)), contract.labels, k)
        body["top_k"] = rows[0] if decoded.single else rows
    return Response(json.dumps(body), media_type="application/json")
