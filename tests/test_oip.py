"""The Open Inference Protocol codec (``fx_lightning.serve.oip``) without a server: infer requests in JSON and with
the binary tensor extension decode into the contract's arrays, outputs encode as asked, what does not fit is a 4xx
naming the input, and the configuration ``fx-lightning serve`` states is the one the Triton repository writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest

from fx_lightning.serve import oip
from fx_lightning.serve.contract import BadRequest, Contract
from fx_lightning.serve.triton_config import config_json, config_text, contract_model, stated_leaf

CONTRACT = Contract([stated_leaf("image", "float32", [None, 3, 4, 4]), stated_leaf("mask", "bool", [None, 4])],
                    outputs=[stated_leaf("scores", "float32", [None, 5]), stated_leaf("count", "int64", [None])])
OUTPUTS = ["scores", "count"]
MODEL = contract_model("m", CONTRACT, "onnx", "fx-lightning", Path("."), max_batch_size=16)
RNG = np.random.default_rng(0)
IMAGE = RNG.standard_normal((2, 3, 4, 4)).astype(np.float32)
MASK = RNG.random((2, 4)) > 0.5


def _item(name: str, array: np.ndarray, datatype: str, binary: bool) -> Dict[str, Any]:
    item: Dict[str, Any] = {"name": name, "shape": list(array.shape), "datatype": datatype}
    if binary:
        item["parameters"] = {"binary_data_size": array.nbytes}
    else:
        item["data"] = array.reshape(-1).tolist()
    return item


def _body(binary: bool, outputs: Optional[List[Dict[str, Any]]] = None, **extra: Any) -> tuple:
    head: Dict[str, Any] = {"id": "r1", "inputs": [_item("mask", MASK, "BOOL", binary),
                                                   _item("image", IMAGE, "FP32", binary)], **extra}
    if outputs is not None:
        head["outputs"] = outputs
    text = json.dumps(head).encode()
    if not binary:
        return text, None
    return text + MASK.tobytes() + IMAGE.tobytes(), str(len(text))


@pytest.mark.parametrize("binary", [False, True])
def test_an_infer_request_decodes_into_the_contracts_arrays_in_the_models_order(binary: bool) -> None:
    body, header = _body(binary)
    request = oip.decode_infer(CONTRACT, MODEL, body, header)
    image, mask = request.decoded.arrays
    assert image.dtype == np.float32 and image.shape == (2, 3, 4, 4) and np.array_equal(image, IMAGE)
    assert mask.dtype == np.bool_ and np.array_equal(mask, MASK)
    assert request.id == "r1" and request.decoded.batch_size == 2 and not request.decoded.single
    assert request.outputs == [oip.Wanted("scores", False), oip.Wanted("count", False)]


def test_outputs_are_encoded_as_asked_json_or_binary() -> None:
    body, _ = _body(False, outputs=[{"name": "count"}, {"name": "scores", "parameters": {"binary_data": True}}])
    request = oip.decode_infer(CONTRACT, MODEL, body, None)
    scores, count = RNG.standard_normal((2, 5)).astype(np.float32), np.array([3, 1], dtype=np.int64)
    content, headers = oip.encode_infer(MODEL, request, [scores, count])
    size = int(headers[oip.BINARY_HEADER])
    head = json.loads(content[:size])
    assert head["model_name"] == "m" and head["model_version"] == "1" and head["id"] == "r1"
    assert [(o["name"], o["datatype"], o["shape"]) for o in head["outputs"]] == [
        ("count", "INT64", [2, 1]), ("scores", "FP32", [2, 5])]  # a per-sample scalar as Triton states it
    assert head["outputs"][0]["data"] == [3, 1]
    got = np.frombuffer(content[size:], dtype=np.float32).reshape(2, 5)
    assert head["outputs"][1]["parameters"]["binary_data_size"] == scores.nbytes and np.array_equal(got, scores)
    # binary_data_output asks for every output in binary; none asked: plain JSON.
    everything = oip.decode_infer(CONTRACT, MODEL, _body(False, parameters={"binary_data_output": True})[0], None)
    assert all(w.binary for w in everything.outputs)
    plain, plain_headers = oip.encode_infer(MODEL, oip.decode_infer(CONTRACT, MODEL, _body(False)[0], None),
                                            [scores, count])
    assert oip.BINARY_HEADER not in plain_headers
    assert np.allclose(json.loads(plain)["outputs"][0]["data"], scores.reshape(-1))


def _refused(body: bytes, header: Optional[str] = None) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        oip.decode_infer(CONTRACT, MODEL, body, header)
    return info.value


def _json(**changes: Any) -> bytes:
    head = json.loads(_body(False)[0])
    for index, item in changes.pop("inputs", {}).items():
        head["inputs"][index] = item
    head.update(changes)
    return json.dumps(head).encode()


@pytest.mark.parametrize("body, header, status, words", [
    (b"{not json", None, 400, ["malformed JSON"]),
    (json.dumps({"inputs": 3}).encode(), None, 400, ["'inputs'"]),
    (_json(inputs={0: _item("weights", MASK, "BOOL", False)}), None, 400, ["unknown input 'weights'", "image"]),
    (_json(inputs={1: _item("image", IMAGE.astype(np.float64), "FP64", False)}), None, 400,
     ["input 'image'", "'FP64'", "FP32"]),
    (_json(inputs={1: _item("image", IMAGE[:, :, :3], "FP32", False)}), None, 400,
     ["input 'image'", "[2, 3, 3, 4]", "[-1, 3, 4, 4]"]),
    (_json(inputs={1: {**_item("image", IMAGE, "FP32", False), "data": [1.0] * 5}}), None, 400, ["5 values"]),
    (json.dumps({"inputs": [_item("image", IMAGE, "FP32", False)]}).encode(), None, 400, ["missing ['mask']"]),
    (_json(outputs=[{"name": "logits"}]), None, 400, ["unknown output 'logits'", "scores"]),
    (_json(outputs=[{"name": "scores", "parameters": {"classification": 3}}]), None, 400,
     ["classification extension", "'scores'"]),
    (_body(True)[0], "99999", 400, ["Inference-Header-Content-Length", "99999"]),
    (_body(True)[0][:-8], _body(True)[1], 400, ["input 'image'", "binary_data_size", "runs past"]),
    (_body(True)[0] + b"extra", _body(True)[1], 400, ["binary section", "add up"]),
    (_json(inputs={1: _item("image", np.full_like(IMAGE, np.nan), "FP32", False)}), None, 422,
     ["input 'image'", "NaN"]),
])
def test_what_does_not_fit_is_a_4xx_naming_the_problem(body: bytes, header: Optional[str], status: int,
                                                        words: List[str]) -> None:
    refused = _refused(body, header)
    assert refused.status == status, refused.message
    for word in words:
        assert word in refused.message, refused.message


def test_the_servers_config_is_the_repositorys_record_and_its_metadata_follows() -> None:
    model = contract_model("m", CONTRACT, "onnx", "fx-lightning", Path("."), max_batch_size=16,
                           max_queue_delay_us=5000)
    config = config_json(model)
    assert config["max_batch_size"] == 16 and config["dynamic_batching"]["max_queue_delay_microseconds"] == 5000
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("image", "TYPE_FP32", [3, 4, 4]), ("mask", "TYPE_BOOL", [4])]
    assert config["output"][1] == {"name": "count", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}}
    text = config_text(model)
    assert 'name: "count"' in text and "reshape: { shape: [ ] }" in text
    metadata = oip.model_metadata(model, "fx-lightning:onnx")
    assert metadata["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 4, 4]},
                                  {"name": "mask", "datatype": "BOOL", "shape": [-1, 4]}]
    assert metadata["outputs"][1] == {"name": "count", "datatype": "INT64", "shape": [-1, 1]}  # Triton's dims
    # Without batching: full dims, the sample axis any size.
    whole = contract_model("m", CONTRACT, "onnx", "fx-lightning", Path("."), max_batch_size=0)
    assert whole.max_batch_size == 0 and [list(whole.dims(t)) for t in whole.inputs] == [[-1, 3, 4, 4], [-1, 4]]
    assert oip.model_metadata(whole, "x")["inputs"][0]["shape"] == [-1, 3, 4, 4]


def test_statistics_keep_tritons_shape_and_survive_pickling() -> None:
    import pickle

    stats = oip.Statistics()
    stats.record(total_ns=10_000, decode_ns=1_000, wait_ns=7_000, infer_ns=5_000, encode_ns=2_000, samples=3)
    for _ in range(4):  # four requests served by one batched run: one execution
        stats.record(total_ns=0, decode_ns=0, wait_ns=0, infer_ns=0, encode_ns=0, samples=1, requests_in_run=4)
    stats.record_failure(500)
    copy = pickle.loads(pickle.dumps(stats))  # LitServe pickles the spec into each worker
    for current in (stats, copy):
        model = current.to_dict("m")["model_stats"][0]
        assert model["name"] == "m" and model["inference_count"] == 7 and model["execution_count"] == 2
        inference = model["inference_stats"]
        assert inference["success"] == {"count": 5, "ns": 10_000} and inference["fail"] == {"count": 1, "ns": 500}
        assert inference["queue"]["ns"] == 2_000 and inference["compute_infer"]["ns"] == 5_000
    copy.record(total_ns=1, decode_ns=0, wait_ns=1, infer_ns=1, encode_ns=0, samples=1)  # its lock works


def test_a_per_sample_scalar_is_sent_and_answered_as_triton_states_it() -> None:
    """An input with no axis but the sample axis is [N, 1] on the wire (the config's dims: [1], reshape []), as
    Triton takes it, and reaches the model as [N]; an output so shaped goes back as [N, 1]."""
    contract = Contract([stated_leaf("lengths", "int64", [None])], outputs=[stated_leaf("y", "float32", [None])])
    model = contract_model("m", contract, "pt2", "fx-lightning", Path("."), max_batch_size=8)
    body = json.dumps({"inputs": [{"name": "lengths", "shape": [3, 1], "datatype": "INT64", "data": [4, 5, 6]}]})
    request = oip.decode_infer(contract, model, body.encode(), None)
    assert request.decoded.arrays[0].shape == (3,) and request.decoded.arrays[0].tolist() == [4, 5, 6]
    flat = json.dumps({"inputs": [{"name": "lengths", "shape": [3], "datatype": "INT64", "data": [4, 5, 6]}]})
    assert "[-1, 1]" in _refused_by(contract, model, flat.encode()).message
    content, _ = oip.encode_infer(model, request, [np.array([0.5, 1.5, 2.5], dtype=np.float32)])
    out = json.loads(content)["outputs"][0]
    assert out["shape"] == [3, 1] and out["data"] == [0.5, 1.5, 2.5]
    with pytest.raises(ValueError, match="returned 2 outputs"):
        oip.encode_infer(model, request, [np.zeros(3, np.float32)] * 2)


def _refused_by(contract: Contract, model: Any, body: bytes) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        oip.decode_infer(contract, model, body, None)
    return info.value
