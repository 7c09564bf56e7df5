"""The input contract a server enforces (fx_lightning.serve.contract), without a server: each body form decodes to
the arrays the model takes, in the layout and channel order the export's prologue expects, and each misfit is
refused with the status and a message naming what was expected and what came."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import List

import numpy as np
import pytest

from fx_lightning.export.manifest import Manifest, Preprocess
from fx_lightning.serve.contract import BadRequest, Contract, top_k_labels
from fx_lightning.serve.triton_config import stated_leaf
from fx_lightning.signature.signature import DimKind, DimSpec, LeafSpec

PIL = pytest.importorskip("PIL.Image")


def _image_contract(layout: str = "NCHW", order: str = "RGB", channels: int = 3) -> Contract:
    shape = [channels, 6, 5] if layout == "NCHW" else [6, 5, channels]
    pre = Preprocess(mean=[0.5] * channels, std=[0.25] * channels, layout=layout, channel_order=order)
    return Contract([stated_leaf("image", "uint8", [None, *shape])], preprocess=pre, labels=["a", "b"])


def _png(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    PIL.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


PIXELS = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)  # height 6, width 5, RGB


@pytest.mark.parametrize("layout,order", [("NCHW", "RGB"), ("NHWC", "RGB"), ("NCHW", "BGR"), ("NHWC", "BGR")])
def test_png_is_laid_out_as_the_prologue_expects(layout: str, order: str) -> None:
    decoded = _image_contract(layout, order).decode(_png(PIXELS), "image/png")
    (array,) = decoded.arrays
    hwc = PIXELS[:, :, ::-1] if order == "BGR" else PIXELS
    want = hwc[None] if layout == "NHWC" else hwc.transpose(2, 0, 1)[None]
    assert array.dtype == np.uint8 and array.shape == want.shape
    assert np.array_equal(array, want)
    assert decoded.single


def test_grey_png_and_jpeg() -> None:
    grey = PIXELS[:, :, 0]
    (array,) = _image_contract(channels=1).decode(_png(grey), "image/png").arrays
    assert np.array_equal(array, grey[None, None])
    (array,) = _image_contract().decode(_png(PIXELS, "JPEG"), "image/jpeg").arrays
    assert array.shape == (1, 3, 6, 5)  # lossy, so only the layout is exact


@pytest.mark.parametrize("body,content_type,status,words", [
    (_png(np.zeros((7, 5, 3), np.uint8)), "image/png", 422, ["5x7", "takes 5x6"]),
    (b"\x89PNG\r\n\x1a\n broken", "image/png", 400, ["not a readable image"]),
    (_png(np.zeros((6000, 6000), np.uint8)), "image/png", 422, ["6000x6000"]),  # refused before decoding
])
def test_bad_images(body: bytes, content_type: str, status: int, words: List[str]) -> None:
    with pytest.raises(BadRequest) as info:
        _image_contract().decode(body, content_type)
    assert info.value.status == status
    for word in words:
        assert word in info.value.message


def test_uint8_json_values_must_be_integers_in_range() -> None:
    contract = _image_contract()
    ok = contract.decode(json.dumps({"inputs": [PIXELS.transpose(2, 0, 1).tolist()]}).encode(), "application/json")
    assert ok.arrays[0].dtype == np.uint8 and np.array_equal(ok.arrays[0][0], PIXELS.transpose(2, 0, 1))
    for value, words in ((256, ["0..256", "uint8 (0..255)"]), (-1, ["-1..", "uint8"]), (0.5, ["integers", "0.5"])):
        sample = np.zeros((3, 6, 5)).tolist()
        sample[0][0][0] = value
        with pytest.raises(BadRequest) as info:
            contract.decode(json.dumps({"inputs": [sample]}).encode(), "application/json")
        assert info.value.status == 422
        for word in words:
            assert word in info.value.message, info.value.message


def test_two_inputs_by_name_and_npz() -> None:
    contract = Contract([stated_leaf("image", "float32", [None, 3, 4]), stated_leaf("mask", "int64", [None, None])])
    a, b = np.ones((2, 3, 4), np.float32), np.arange(10, dtype=np.int64).reshape(2, 5)
    decoded = contract.decode(json.dumps({"inputs": {"mask": b.tolist(), "image": a.tolist()}}).encode(),
                              "application/json")
    assert [x.dtype for x in decoded.arrays] == [np.float32, np.int64]
    assert np.array_equal(decoded.arrays[1], b) and decoded.batch_size == 2
    buffer = io.BytesIO()
    np.savez(buffer, image=a, mask=b)
    decoded = contract.decode(buffer.getvalue(), "application/x-npz")
    assert np.array_equal(decoded.arrays[0], a) and np.array_equal(decoded.arrays[1], b)
    with pytest.raises(BadRequest, match="batch sizes differ"):
        contract.decode(json.dumps({"inputs": [a.tolist(), b[:1].tolist()]}).encode(), "application/json")
    with pytest.raises(BadRequest, match="send them as application/x-npz"):
        contract.decode(buffer.getvalue(), "application/x-npy")


def test_contract_of_a_manifest_refuses_what_a_server_cannot_take() -> None:
    manifest = Manifest(formats={}, inputs=[{"name": "x", "kind": "tensor", "shape": ["batch", 3], "dtype": "float32"},
                                            {"name": "flag", "kind": "bool", "value": "True"}])
    with pytest.raises(ValueError, match="'flag' is a bool"):
        Contract.of(manifest)
    manifest.inputs = [{"name": "x.image", "kind": "tensor", "shape": ["batch", 3], "dtype": "float32"}]
    with pytest.raises(ValueError, match="nested inside an argument"):
        Contract.of(manifest)
    manifest.inputs = [{"name": "x", "kind": "tensor", "shape": ["batch", 3], "dtype": "complex64"}]
    with pytest.raises(ValueError, match="complex64: not served"):
        Contract.of(manifest)


def test_a_version_1_manifest_states_its_contract_from_the_tensors_it_recorded() -> None:
    """Before signatures (format version 1) a manifest's inputs and outputs were the record: dim 0 the batch."""
    from pathlib import Path

    from fx_lightning.export.manifest import read_manifest
    from fx_lightning.serve.triton_config import contract_model

    contract = Contract.of(read_manifest(Path(__file__).parent / "data" / "export_v1"))
    assert contract.batched and [(s.name, contract.request_sizes(s)) for s in contract.inputs] == [
        ("input_1", (3, 8, 8))]
    assert contract.to_dict()["outputs"] == [{"name": "output_0", "shape": ["batch", 3], "dtype": "float32"}]
    model = contract_model("m", contract, "pt2", "python", Path("."), max_batch_size=4)
    assert [list(model.dims(t)) for t in model.inputs + model.outputs] == [[3, 8, 8], [3]]


def test_top_k_is_softmax_ranked() -> None:
    scores = np.array([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]], np.float32)
    rows = top_k_labels(scores, ["x", "y", "z"], 2)
    assert [[r["label"] for r in row] for row in rows] == [["y", "z"], ["x", "y"]]
    expected = np.exp(2.0) / np.exp([0.0, 2.0, 1.0]).sum()
    assert abs(rows[0][0]["probability"] - expected) / expected < 1e-12


def test_a_bfloat16_input_left_out_gets_its_stand_in_as_float32_like_the_inputs_given() -> None:
    """A bfloat16 model's optional mask, proven to be all ones when left out: numpy has no bfloat16, so the stand-in
    travels as float32 (the worker casts it for the model), as a bfloat16 input sent in the request does. It raised
    TypeError (numpy() of a bfloat16 tensor) on every request leaving the mask out."""
    sample = DimSpec(DimKind.sample, 2, 1, 8)
    x = LeafSpec("x", "x", (), "bfloat16", (sample, DimSpec(DimKind.fixed, 4, 4, 4)))
    mask = dataclasses.replace(x, name="mask", path="mask", absent_fill=1.0)
    contract = Contract([x, mask])
    decoded = contract.decode(json.dumps({"inputs": {"x": np.ones((3, 4)).tolist()}}).encode(), "application/json")
    assert [a.dtype for a in decoded.arrays] == [np.float32, np.float32]
    assert np.array_equal(decoded.arrays[1], np.ones((3, 4), np.float32))
