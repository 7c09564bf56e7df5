"""The Open Inference Protocol (KServe v2 REST, as Triton Inference Server speaks it) for an export's contract:
request bodies decoded into the contract's arrays, outputs encoded, the metadata, configuration and statistics
documents. No web framework here: :mod:`fx_lightning.serve.app` routes the endpoints to these functions.

An infer request is a JSON object ``{"id", "parameters", "inputs": [{"name", "shape", "datatype", "data" |
"parameters": {"binary_data_size"}}], "outputs": [{"name", "parameters": {"binary_data"}}]}``; with the binary
tensor extension the JSON is followed by the tensors' raw bytes, its length in the
``Inference-Header-Content-Length`` header. Every input is named, typed and shaped; the shape includes the sample
axis where the model batches (``max_batch_size`` > 0), exactly as in the Triton repository
(:mod:`fx_lightning.serve.triton`), so a client moves between the two without a change. What does not fit the
protocol is a 400, what does not fit the contract the contract's own 4xx, each with ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from fx_lightning._version import __version__
from fx_lightning.common.dtypes import BY_TORCH
from fx_lightning.serve.contract import BadRequest, Contract, Decoded, parse_json
from fx_lightning.serve.triton_config import TritonModel
from fx_lightning.signature.signature import LeafSpec

__all__ = ["BINARY_HEADER", "MODEL_VERSION", "EXTENSIONS", "Wanted", "InferRequest", "decode_infer",
           "encode_infer", "server_metadata", "model_metadata", "Statistics"]

BINARY_HEADER = "Inference-Header-Content-Length"
MODEL_VERSION = "1"  # one version per served export, as in the Triton repository
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]



@dataclass(frozen=True)
class Wanted:
    """An output the client asked for, and whether it wants it as binary data."""

    name: str
    binary: bool


@dataclass
class InferRequest:
    """A decoded infer request: the contract's arrays (in the model's input order), its id and the outputs to
    return (all of them, in the model's order, unless it named some)."""

    decoded: Decoded
    outputs: List[Wanted]
    id: Optional[str] = None


def decode_infer(contract: Contract, model: TritonModel, body: bytes, header_length: Optional[str]) -> InferRequest:
    """The infer request in ``body`` (JSON, or JSON then binary tensors when ``header_length`` is given), checked
    against the protocol and the model's stated tensors (``model``: its config), then the contract; raises
    :class:`BadRequest`."""
    contract.refuse_oversized(body)
    json_part, binary = _split(body, header_length)
    data = parse_json(json_part, "JSON infer request")
    if not isinstance(data, dict) or not isinstance(data.get("inputs"), list):
        raise BadRequest(400, "an infer request is a JSON object with 'inputs': a list of "
                              "{name, shape, datatype, data}")
    by_name = {t.name: t for t in model.inputs}  # the contract's inputs as the model states them
    given: Dict[str, np.ndarray] = {}
    offset = 0
    for i, item in enumerate(data["inputs"]):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadRequest(400, f"inputs[{i}]: expected an object with a 'name', got {_kind(item)}")
        name = item["name"]
        if name not in by_name:
            raise BadRequest(400, f"inputs[{i}]: unknown input {name!r}; the model's inputs are {list(by_name)}")
        if name in given:
            raise BadRequest(400, f"inputs[{i}]: input {name!r} given twice")
        given[name], offset = _input_array(model, by_name[name], item, binary, offset)
    if offset != len(binary):
        raise BadRequest(400, f"the binary section holds {len(binary)} bytes, the inputs' binary_data_size add up "
                              f"to {offset}")
    missing = [s.name for s in contract.inputs if s.name not in given and not s.optional]
    if missing:
        raise BadRequest(400, f"inputs: missing {missing}; the model's inputs are {list(by_name)}")
    decoded = contract.checked([given.get(s.name) for s in contract.inputs])  # None: its proven stand-in
    request_id = data.get("id")
    return InferRequest(decoded, _wanted(data, [t.name for t in model.outputs]),
                        str(request_id) if request_id is not None else None)


def _split(body: bytes, header_length: Optional[str]) -> Tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    if not header_length.strip().isdigit() or int(header_length) > len(body):
        raise BadRequest(400, f"{BINARY_HEADER}: {header_length!r}; expected the JSON part's length in bytes, at "
                              f"most the body's {len(body)}")
    size = int(header_length)
    return body[:size], body[size:]


def _input_array(model: TritonModel, tensor: LeafSpec, item: Mapping[str, Any], binary: bytes,
                 offset: int) -> Tuple[np.ndarray, int]:
    """One input as the contract's array (the config's reshape applied), and the binary section's offset after it."""
    where = f"input {tensor.name!r}"
    row = BY_TORCH[tensor.dtype]  # the contract serves only dtypes of the table
    want_type, want_shape, dtype = row.v2, model.stated_shape(tensor), np.dtype(row.numpy)
    if item.get("datatype") != want_type:
        raise BadRequest(400, f"{where}: datatype {item.get('datatype')!r}; the model takes {want_type}")
    shape = item.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise BadRequest(400, f"{where}: shape {shape!r}; expected a list of sizes, {want_shape}")
    if len(shape) != len(want_shape) or any(w != -1 and w != d for w, d in zip(want_shape, shape)):
        raise BadRequest(400, f"{where}: shape {shape}; the model takes {want_shape} (-1: any size)")
    count = int(np.prod(shape, dtype=np.int64))
    parameters = item.get("parameters") or {}
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size != count * dtype.itemsize:
            raise BadRequest(400, f"{where}: binary_data_size {size!r}; shape {shape} of {want_type} is "
                                  f"{count * dtype.itemsize} bytes")
        if offset + size > len(binary):
            raise BadRequest(400, f"{where}: binary_data_size {size} runs past the binary section's "
                                  f"{len(binary)} bytes")
        array = np.frombuffer(binary, dtype=dtype, count=count, offset=offset).reshape(shape)
        return _as_model_sees(array, model, tensor), offset + size
    if "data" not in item:
        raise BadRequest(400, f"{where}: no 'data' and no parameters.binary_data_size")
    try:
        raw = np.asarray(item["data"])
    except ValueError as exc:
        raise BadRequest(400, f"{where}: ragged data ({exc})") from None
    if raw.size != count:
        raise BadRequest(400, f"{where}: {raw.size} values for shape {shape} ({count})")
    if raw.size and (raw.dtype.kind not in "biuf" or (raw.dtype.kind == "b") != (dtype.kind == "b")):
        raise BadRequest(400, f"{where}: data of {raw.dtype.kind == 'b' and 'booleans' or 'non-numbers'} for "
                              f"datatype {want_type}")
    if dtype.kind in "iu" and raw.dtype.kind == "f" and raw.size and not np.array_equal(raw, np.round(raw)):
        raise BadRequest(400, f"{where}: non-integer data for datatype {want_type}")
    return _as_model_sees(raw.astype(dtype).reshape(shape), model, tensor), offset


def _as_model_sees(array: np.ndarray, model: TritonModel, tensor: LeafSpec) -> np.ndarray:
    reshape = model.reshape(tensor)
    return array if reshape is None else array.reshape(([array.shape[0]] if model.batching else []) + list(reshape))


def _wanted(data: Mapping[str, Any], output_names: Sequence[str]) -> List[Wanted]:
    parameters = data.get("parameters") if isinstance(data.get("parameters"), dict) else {}
    binary_default = bool(parameters.get("binary_data_output", False))
    asked = data.get("outputs")
    if asked is None:
        return [Wanted(n, binary_default) for n in output_names]
    if not isinstance(asked, list):
        raise BadRequest(400, f"outputs: expected a list of {{name}}, got {_kind(asked)}")
    wanted = []
    for i, item in enumerate(asked):
        name = item.get("name") if isinstance(item, dict) else None
        if name not in output_names:
            raise BadRequest(400, f"outputs[{i}]: unknown output {name!r}; the model's outputs are "
                                  f"{list(output_names)}")
        own = item.get("parameters") if isinstance(item.get("parameters"), dict) else {}
        if own.get("classification"):
            raise BadRequest(400, f"outputs[{i}]: the classification extension is not served; ask for {name!r} "
                                  "itself (its scores) and take the top classes on the client")
        wanted.append(Wanted(name, bool(own.get("binary_data", binary_default))))
    return wanted


def encode_infer(model: TritonModel, request: InferRequest, outputs: Sequence[np.ndarray]
                 ) -> Tuple[bytes, Dict[str, str]]:
    """The response body and its headers: the JSON part, then the binary outputs when any was asked for so. Each
    output is shaped as the config states it and typed as it declares; raises ValueError when the run's outputs are
    not the model's."""
    if len(outputs) != len(model.outputs):
        raise ValueError(f"the artifact returned {len(outputs)} outputs, the model states "
                         f"{[t.name for t in model.outputs]}")
    by_name = {t.name: (t, o) for t, o in zip(model.outputs, outputs)}
    described, chunks = [], []
    for want in request.outputs:
        tensor, array = by_name[want.name]
        datatype = BY_TORCH[tensor.dtype].v2
        array = np.ascontiguousarray(array, dtype=BY_TORCH[tensor.dtype].numpy)  # bf16: float32 stands in
        if model.reshape(tensor) is not None:
            array = array.reshape(([array.shape[0]] if model.batching else []) + list(model.dims(tensor)))
        item: Dict[str, Any] = {"name": want.name, "datatype": datatype, "shape": list(array.shape)}
        if want.binary:
            raw = array.tobytes()
            item["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            item["data"] = array.reshape(-1).tolist()
        described.append(item)
    head: Dict[str, Any] = {"model_name": model.name, "model_version": MODEL_VERSION, "outputs": described}
    if request.id is not None:
        head["id"] = request.id
    text = json.dumps(head).encode()
    if not chunks:
        return text, {"content-type": "application/json"}
    return text + b"".join(chunks), {"content-type": "application/octet-stream", BINARY_HEADER: str(len(text))}


def server_metadata() -> Dict[str, object]:
    return {"name": "fx-lightning", "version": __version__, "extensions": EXTENSIONS}


def model_metadata(model: TritonModel, platform: str) -> Dict[str, object]:
    """``GET /v2/models/{name}``: names, datatypes and shapes (-1 where a size varies, the sample axis included
    where the model batches), as the Triton repository's config states them."""
    def tensors(items: Sequence[LeafSpec]) -> List[Dict[str, object]]:
        return [{"name": t.name, "datatype": BY_TORCH[t.dtype].v2, "shape": model.stated_shape(t)}
                for t in items]

    return {"name": model.name, "versions": [MODEL_VERSION], "platform": platform,
            "inputs": tensors(model.inputs), "outputs": tensors(model.outputs)}


def _kind(value: Any) -> str:
    return "null" if value is None else f"a JSON {type(value).__name__}"


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass
class Statistics:
    """Triton's per-model inference statistics (``GET /v2/models/{name}/stats``), kept by the HTTP process:
    ``success`` from a request's arrival to its response, ``compute_input`` decoding, ``queue`` waiting for a
    worker (the wait less the worker's run), ``compute_infer`` the worker's run of the batch it was in,
    ``compute_output`` encoding; ``fail`` requests refused or failed; ``execution_count`` the model's runs (a
    batched run counted once). Thread-safe."""

    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    inference_count: int = 0
    executions: float = 0.0  # each request adds 1 / the requests its run served: whole runs once all are in
    last_inference_ms: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __getstate__(self) -> Dict[str, Any]:  # LitServe pickles the spec into each worker: the lock stays here
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def record(self, *, total_ns: int, decode_ns: int, wait_ns: int, infer_ns: int, encode_ns: int,
               samples: int, requests_in_run: int = 1) -> None:
        with self._lock:
            self.executions += 1.0 / max(1, requests_in_run)
            self.success.add(total_ns)
            self.compute_input.add(decode_ns)
            self.queue.add(max(0, wait_ns - infer_ns))
            self.compute_infer.add(infer_ns)
            self.compute_output.add(encode_ns)
            self.inference_count += samples
            self.last_inference_ms = int(time.time() * 1000)

    def record_failure(self, total_ns: int) -> None:
        with self._lock:
            self.fail.add(total_ns)

    def to_dict(self, model_name: str) -> Dict[str, object]:
        with self._lock:
            stats = {k: {"count": getattr(self, k).count, "ns": getattr(self, k).ns} for k in
                     ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")}
            stats.update(cache_hit={"count": 0, "ns": 0}, cache_miss={"count": 0, "ns": 0})
            return {"model_stats": [{
                "name": model_name, "version": MODEL_VERSION, "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count, "execution_count": round(self.executions),
                "inference_stats": stats, "batch_stats": []}]}
