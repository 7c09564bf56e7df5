"""The input contract of an export, as a server enforces it: what each request body may hold, decoded into arrays
or refused with a 4xx that names what was expected and what came.

Read from ``manifest.json`` alone (:meth:`Contract.of`), so a server needs no training code. Accepted bodies:

- ``application/json``: ``{"inputs": [...]}``, one nested list per model input in order, or an object keyed by
  input name; optional ``"top_k"``. Each input holds a batch (its full rank) or one sample (rank - 1).
- ``application/x-npy``: one ``.npy`` array (a single-input model); ``application/x-npz``: one array per input,
  keyed by input name (or ``arr_0``... in order). Loaded without pickle.
- ``image/png``, ``image/jpeg``: one image, when the export carries an image contract (``export.preprocess``
  with uint8 input): its size must be the model's, and it is laid out as the contract says.

Nothing here imports a web framework: the server (:mod:`fx_lightning.serve.server`) calls :meth:`Contract.decode`
and turns a :class:`BadRequest` into its status code.
"""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from fx_lightning.common.dtypes import DTYPES

from fx_lightning.export.manifest import Manifest, Preprocess, is_tensor
from fx_lightning.signature.absent import stand_in
from fx_lightning.signature.signature import LeafSpec

__all__ = ["DEFAULT_MAX_REQUEST_BATCH", "DEFAULT_MAX_BODY_MB", "BadRequest", "Contract", "Decoded", "JSON_TYPE",
           "NPY_TYPE", "NPZ_TYPE", "IMAGE_TYPES", "parse_json", "top_k_labels"]

JSON_TYPE = "application/json"
NPY_TYPE = "application/x-npy"
NPZ_TYPE = "application/x-npz"
IMAGE_TYPES = ("image/png", "image/jpeg")

# The request limits' defaults (``fx-lightning serve --max-request-batch``, ``--max-body-mb``).
DEFAULT_MAX_REQUEST_BATCH = 64
DEFAULT_MAX_BODY_MB = 32

# numpy dtypes of the torch dtype names a manifest records, from the one dtype table (bfloat16 has no numpy dtype:
# float32 stands in, and the worker casts it to bfloat16 for the model).
_NUMPY_DTYPES: Dict[str, np.dtype] = {d.torch: np.dtype(d.numpy) for d in DTYPES}


class BadRequest(Exception):
    """A request the contract refuses: ``status`` (400 malformed, 413 too large, 415 content type, 422 does not
    fit the contract) and a message naming what was expected and what came."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Decoded:
    """A request's inputs as arrays with a batch axis, and whether it sent one sample without one."""

    arrays: List[np.ndarray]
    single: bool = False
    top_k: Optional[int] = None

    @property
    def batch_size(self) -> int:
        return int(self.arrays[0].shape[0]) if self.arrays[0].ndim else 1


@dataclass
class Contract:
    """What the server accepts: the inputs (the signature's leaves), the limits, the image layout when there is one,
    and the labels. ``batched``: the export has a proven sample axis (dim 0 of every input and output), so requests
    hold samples and are batched together; without one a request is the model's whole input and runs alone.
    ``any_samples``: the artifacts take any number of samples (else the example's: ``export.dynamic_batch`` false)."""

    inputs: List[LeafSpec]
    outputs: List[LeafSpec] = field(default_factory=list)
    preprocess: Optional[Preprocess] = None
    labels: List[str] = field(default_factory=list)
    max_request_batch: int = DEFAULT_MAX_REQUEST_BATCH
    max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20
    batched: bool = True
    any_samples: bool = True

    @classmethod
    def of(cls, manifest: Manifest, *, max_request_batch: int = DEFAULT_MAX_REQUEST_BATCH,
           max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20) -> "Contract":
        """The contract of an export. Raises ValueError for inputs a server cannot take (non-tensor or nested)."""
        other = next((view for view in manifest.inputs if not is_tensor(view)), None)
        if other is not None:
            raise ValueError(f"input {other.get('name')!r} is a {other.get('kind')} ({other.get('value')}), not a "
                             "tensor: a server takes tensor inputs only")
        signature = manifest.call_signature()
        for leaf in signature.inputs:
            if "." in leaf.name:
                raise ValueError(f"input {leaf.name!r} is nested inside an argument: a server takes one tensor per "
                                 "forward argument")
            if leaf.dtype not in _NUMPY_DTYPES:
                raise ValueError(f"input {leaf.name!r} has dtype {leaf.dtype}: not served (allowed: "
                                 f"{', '.join(_NUMPY_DTYPES)})")
        if not signature.inputs:
            raise ValueError("the manifest lists no tensor inputs")
        batched = signature.batched and all(a == 0 for a in signature.input_axes() + signature.output_axes())
        return cls(list(signature.inputs), list(signature.outputs), manifest.preprocess, list(manifest.labels),
                   max_request_batch, max_body_bytes, batched, manifest.dynamic_batch)

    def request_sizes(self, leaf: LeafSpec) -> Tuple[Optional[int], ...]:
        """The sizes a request gives an input: of one sample where the contract batches, else of the whole input
        (None: any size on that axis)."""
        sizes = leaf.sizes(self.any_samples)
        return tuple(sizes[1:] if self.batched else sizes)

    def output_names(self, count: int) -> List[str]:
        """The outputs' names, or ``output_<i>`` when a run returned another number of outputs."""
        return [o.name for o in self.outputs] if len(self.outputs) == count else [f"output_{i}" for i in range(count)]

    def shape_text(self, leaf: LeafSpec) -> str:
        dims = ["any" if d is None else str(d) for d in self.request_sizes(leaf)]
        return "[" + ", ".join(["batch", *dims] if self.batched else dims) + "]"

    # ------------------------------------------------------------------------------------------- decoding

    def refuse_oversized(self, body: bytes) -> None:
        """A 413 for a body over the limit (``--max-body-mb``)."""
        if len(body) > self.max_body_bytes:
            raise BadRequest(413, f"body of {len(body)} bytes exceeds the limit of {self.max_body_bytes} bytes "
                                  "(--max-body-mb)")

    def decode(self, body: bytes, content_type: str, query: Mapping[str, str] = {}) -> Decoded:
        """The request's inputs, checked against the contract; raises :class:`BadRequest`."""
        self.refuse_oversized(body)
        if not body:
            raise BadRequest(400, "empty body: send JSON {\"inputs\": [...]}, an .npy/.npz array or an image")
        media = content_type.split(";")[0].strip().lower()
        top_k = _top_k(query.get("top_k"), "query parameter top_k")
        if media == JSON_TYPE:
            return self._from_json(body, top_k)
        if media in (NPY_TYPE, NPZ_TYPE):
            return self.checked(self._from_numpy(body, media), top_k)
        if media in IMAGE_TYPES:
            return self._from_image(body, media, top_k)
        raise BadRequest(415, f"content type {content_type or '(none)'!r} is not accepted; send "
                              f"{', '.join(self.content_types)}")

    @property
    def content_types(self) -> List[str]:
        return [JSON_TYPE, NPY_TYPE, NPZ_TYPE] + (list(IMAGE_TYPES) if self.image_size is not None else [])

    @property
    def image_size(self) -> Optional[Tuple[Optional[int], Optional[int], int]]:
        """(height, width, channels) of the image an image request must be, when the export takes raw pixels
        (a height or width of None: any, the model was shown to take other sizes)."""
        if self.preprocess is None or len(self.inputs) != 1 or self.inputs[0].dtype != "uint8":
            return None
        dims = self.request_sizes(self.inputs[0])
        if len(dims) != 3:
            return None
        c, h, w = dims if self.preprocess.layout == "NCHW" else (dims[2], dims[0], dims[1])
        if c not in (1, 3):
            return None
        return h, w, c

    def _from_json(self, body: bytes, query_top_k: Optional[int]) -> Decoded:
        data = parse_json(body, "JSON")
        if not isinstance(data, dict) or "inputs" not in data:
            got = "an object without 'inputs'" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
            raise BadRequest(422, f"expected a JSON object {{\"inputs\": [...]}}, got {got}")
        given = data["inputs"]
        names = [s.name for s in self.inputs]
        if isinstance(given, dict):
            values = self.by_name(given)
        elif isinstance(given, list):
            if len(given) != len(names):
                raise BadRequest(422, f"inputs: expected {len(names)} array(s), one per model input {names}, got "
                                      f"{len(given)} (a single-input model takes {{\"inputs\": [array]}})")
            values = given
        else:
            raise BadRequest(422, f"inputs: expected a list (one array per input) or an object keyed by input "
                                  f"name, got a JSON {type(given).__name__}")
        arrays = [None if value is None and spec.optional else self._json_array(spec, value)
                  for spec, value in zip(self.inputs, values)]
        top_k = _top_k(data.get("top_k"), "top_k")
        return self.checked(arrays, query_top_k if top_k is None else top_k)

    def by_name(self, given: Mapping[str, Any]) -> List[Any]:
        """The values of ``given`` (keyed by input name) in the inputs' order; a 422 naming unknown and missing keys."""
        names = [s.name for s in self.inputs]
        optional = {s.name for s in self.inputs if s.optional}  # a stand-in is proven: may be left out
        unknown = sorted(set(given) - set(names))
        missing = [n for n in names if n not in given and n not in optional]
        if unknown or missing:
            raise BadRequest(422, f"inputs: expected the keys {names}"
                                  + (f" ({', '.join(sorted(optional))} may be left out)" if optional else "") + "; "
                                  + "; ".join(p for p in (f"unknown {unknown}" if unknown else "",
                                                           f"missing {missing}" if missing else "") if p))
        return [given.get(n) for n in names]

    def _json_array(self, spec: LeafSpec, value: Any) -> np.ndarray:
        where = f"input {spec.name!r}"
        if spec.one_for_all and isinstance(value, (int, float)) and not isinstance(value, bool):
            return self._json_array(spec, [value]).reshape(())  # one value for every sample, checked as any value
        if not isinstance(value, list):
            raise BadRequest(422, f"{where}: expected a nested list of shape {self.shape_text(spec)}, got a JSON "
                                  f"{type(value).__name__}")
        try:
            raw = np.asarray(value)
        except ValueError as exc:
            raise BadRequest(422, f"{where}: ragged nested list ({exc}); expected shape "
                                  f"{self.shape_text(spec)}") from None
        want = _NUMPY_DTYPES[spec.dtype]
        if raw.dtype.kind not in "biuf" or (raw.dtype.kind == "b") != (want.kind == "b") and raw.size:
            if want.kind == "b" and raw.dtype.kind in "iu" and raw.size and set(np.unique(raw).tolist()) <= {0, 1}:
                return raw.astype(bool)
            expected = "true/false (or 0/1)" if want.kind == "b" else f"numbers ({spec.dtype})"
            got = ("true/false" if raw.dtype.kind == "b" else "strings" if raw.dtype.kind in "US"
                   else "null or mixed values" if raw.dtype == object else f"{raw.dtype}")
            raise BadRequest(422, f"{where}: expected {expected}, got {got}")
        if want.kind == "f" and raw.dtype.kind == "f" and raw.size:
            finite = raw[np.isfinite(raw)]
            limit = float(np.finfo(want).max)
            if finite.size and np.abs(finite).max() > limit:
                raise BadRequest(422, f"{where}: {np.abs(finite).max():g} is out of {spec.dtype}'s range "
                                      f"(+-{limit:g})")
        if want.kind in "biu":
            if raw.dtype.kind == "f":
                bad = raw[~np.isfinite(raw) | (raw != np.round(raw))] if raw.size else raw
                if bad.size:
                    raise BadRequest(422, f"{where}: expected {spec.dtype} integers, got {bad.flat[0]!r}")
            if want.kind != "b":
                info = np.iinfo(want)
                if raw.size and (raw.min() < info.min or raw.max() > info.max):
                    raise BadRequest(422, f"{where}: values {raw.min():g}..{raw.max():g} do not fit {spec.dtype} "
                                          f"({info.min}..{info.max})")
        return raw.astype(want, copy=False)

    def _from_numpy(self, body: bytes, media: str) -> List[Optional[np.ndarray]]:
        """The arrays of an ``.npy`` or ``.npz`` body; each header is read first, and an array larger than the
        contract allows is refused before it is allocated or decompressed."""
        names = [s.name for s in self.inputs]
        try:
            if media == NPY_TYPE:
                if len(self.inputs) != 1:
                    raise BadRequest(422, f"the model takes {len(self.inputs)} inputs {names}: send them as "
                                          f"{NPZ_TYPE}")
                arrays = [self._npy(io.BytesIO(body), self.inputs[0])]
            else:
                with zipfile.ZipFile(io.BytesIO(body)) as archive:
                    members = {n[:-4] if n.endswith(".npy") else n: n for n in archive.namelist()}
                    required = {s.name for s in self.inputs if not s.optional}
                    by_name = required <= set(members) <= set(names)  # by name, those with a stand-in optional
                    order = names if by_name else [f"arr_{i}" for i in range(len(names))]
                    if not by_name and (not set(order) <= set(members) or len(members) != len(names)):
                        raise BadRequest(422, f"npz: expected the arrays {names} (or arr_0..arr_{len(names) - 1}), "
                                              f"got {sorted(members)}")
                    arrays: List[Optional[np.ndarray]] = []
                    for key, spec in zip(order, self.inputs):
                        if key not in members:  # left out: its proven stand-in, made once the batch is known
                            arrays.append(None)
                            continue
                        with archive.open(members[key]) as member:
                            arrays.append(self._npy(member, spec))
        except BadRequest:
            raise
        except (ValueError, OSError, EOFError, RuntimeError, MemoryError, zipfile.BadZipFile, zlib.error) as exc:
            raise BadRequest(400, f"malformed {media} body: {type(exc).__name__}: {exc}") from None
        return arrays

    def _npy(self, stream: Any, spec: LeafSpec) -> np.ndarray:
        """One ``.npy`` array of ``spec``'s dtype and at most :attr:`max_request_batch` samples' size."""
        version = np.lib.format.read_magic(stream)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read_header(stream)
        if dtype != _NUMPY_DTYPES[spec.dtype]:
            raise BadRequest(422, f"input {spec.name!r}: expected dtype {spec.dtype}, got {dtype}")
        count = int(np.prod(shape, dtype=np.float64)) if shape else 1
        sizes = self.request_sizes(spec)
        sample = int(np.prod([d or 1 for d in sizes], dtype=np.float64)) or 1
        samples = shape[0] if len(shape) == len(sizes) + 1 else None
        if self.batched and ((samples is not None and samples > self.max_request_batch) or (
                count > sample * self.max_request_batch and all(d is not None for d in sizes))):
            raise BadRequest(413, f"input {spec.name!r}: an array of shape {list(shape)} exceeds the limit of "
                                  f"{self.max_request_batch} samples per request (--max-request-batch)")
        if count * dtype.itemsize > self.max_body_bytes:  # sizes that vary: the header alone may declare any size
            raise BadRequest(413, f"input {spec.name!r}: an array of shape {list(shape)} ({count * dtype.itemsize} "
                                  f"bytes) exceeds the limit of {self.max_body_bytes} bytes (--max-body-mb)")
        data = stream.read(count * dtype.itemsize)
        if len(data) != count * dtype.itemsize:
            raise BadRequest(400, f"input {spec.name!r}: truncated array ({len(data)} of "
                                  f"{count * dtype.itemsize} bytes)")
        array = np.frombuffer(data, dtype=dtype)
        return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)

    def _from_image(self, body: bytes, media: str, top_k: Optional[int]) -> Decoded:
        size = self.image_size
        if size is None:
            raise BadRequest(415, f"{media}: this export has no image contract (export an image classifier with "
                                  "export.preprocess and a uint8 input to send images); send "
                                  f"{', '.join(self.content_types)}")
        height, width, channels = size
        try:
            from PIL import Image
        except ImportError:  # the serve extra installs pillow; a bare install refuses images clearly
            raise BadRequest(415, f"{media}: this server cannot decode images (pip install pillow)") from None
        try:
            with Image.open(io.BytesIO(body)) as image:
                if (width is not None and image.width != width) or (height is not None and image.height != height):
                    raise BadRequest(422, f"image is {image.width}x{image.height} (width x height); the model "
                                          f"takes {width or 'any'}x{height or 'any'}")
                if image.width * image.height * channels > self.max_body_bytes:  # what a small file may unpack to
                    raise BadRequest(413, f"image of {image.width}x{image.height} pixels exceeds the limit of "
                                          f"{self.max_body_bytes} bytes of pixels (--max-body-mb)")
                height, width = image.height, image.width
                pixels = np.asarray(image.convert("RGB" if channels == 3 else "L"), dtype=np.uint8)
        except BadRequest:
            raise
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for a damaged file
            raise BadRequest(400, f"{media}: not a readable image: {type(exc).__name__}: {exc}") from None
        hwc = pixels.reshape(height, width, channels)
        assert self.preprocess is not None  # image_size is set only with a preprocess
        if channels == 3 and self.preprocess.channel_order == "BGR":
            hwc = hwc[:, :, ::-1]
        sample = hwc if self.preprocess.layout == "NHWC" else hwc.transpose(2, 0, 1)
        return Decoded([np.ascontiguousarray(sample)[None]], single=True, top_k=top_k)

    def checked(self, arrays: List[Optional[np.ndarray]], top_k: Optional[int] = None) -> Decoded:
        """The arrays (one per input, in order) checked: rank, shape, batch size and finiteness of each; one sample
        gets its batch axis. Raises :class:`BadRequest`."""
        if not self.batched:
            return self._checked_whole(self._stand_ins(arrays, None), top_k)
        single = None
        for i, (spec, array) in enumerate(zip(self.inputs, arrays)):
            if array is None or spec.one_for_all and array.ndim == 0:
                if array is not None:
                    _refuse_non_finite(spec, array.reshape(1))
                continue  # left out, or one value for every sample: made below, once the batch size is known
            sizes = self.request_sizes(spec)
            rank = len(sizes) + 1
            if array.ndim not in (rank, rank - 1):
                raise BadRequest(422, f"input {spec.name!r}: expected rank {rank} {self.shape_text(spec)} (or rank "
                                      f"{rank - 1} for one sample), got rank {array.ndim} {list(array.shape)}")
            is_single = array.ndim == rank - 1
            if single is not None and is_single != single:
                raise BadRequest(422, "inputs: send every input batched or every input as one sample, not both")
            single = is_single
            batched = array[None] if is_single else array
            if any(want is not None and want != got for want, got in zip(sizes, batched.shape[1:])):
                raise BadRequest(422, f"input {spec.name!r}: expected shape {self.shape_text(spec)}, got "
                                      f"{list(array.shape)}")
            _refuse_non_finite(spec, batched)
            arrays[i] = batched
        sizes = {int(a.shape[0]) for spec, a in zip(self.inputs, arrays)
                 if a is not None and not (spec.one_for_all and a.ndim == 0)}
        if len(sizes) != 1:
            raise BadRequest(422, f"inputs: batch sizes differ across inputs: {sorted(sizes)}")
        size = sizes.pop()
        arrays[:] = self._stand_ins(arrays, size)
        if size < 1:
            raise BadRequest(422, "inputs: batch of 0 samples")
        if size > self.max_request_batch:
            raise BadRequest(413, f"batch of {size} samples exceeds the limit of {self.max_request_batch} per "
                                  "request (--max-request-batch)")
        return Decoded(arrays, bool(single), top_k)

    def _stand_ins(self, arrays: List[Optional[np.ndarray]], size: Optional[int]) -> List[np.ndarray]:
        """``arrays`` with the proven stand-in (:mod:`~fx_lightning.signature.absent`) for each input left out and
        one value given for every sample repeated for the ``size`` samples."""
        out = list(arrays)
        for i, (spec, array) in enumerate(zip(self.inputs, arrays)):
            if array is None:  # bfloat16 travels as float32 (numpy has none), as the inputs given do
                filled = stand_in(self.inputs, spec, arrays)
                out[i] = filled.float().numpy() if spec.dtype == "bfloat16" else filled.numpy()
            elif spec.one_for_all and array.ndim == 0 and size is not None:
                out[i] = np.full((size,), array, dtype=_NUMPY_DTYPES[spec.dtype])
        return out  # type: ignore[return-value]

    def _checked_whole(self, arrays: List[np.ndarray], top_k: Optional[int]) -> Decoded:
        """An export without a sample axis: each array is the whole input, of its rank and fixed sizes."""
        for spec, array in zip(self.inputs, arrays):
            sizes = self.request_sizes(spec)
            if array.ndim != len(sizes) or any(want is not None and want != got
                                               for want, got in zip(sizes, array.shape)):
                raise BadRequest(422, f"input {spec.name!r}: expected shape {self.shape_text(spec)} (the whole input: "
                                      f"this model has no sample axis), got {list(array.shape)}")
            _refuse_non_finite(spec, array)
        return Decoded(arrays, False, top_k)

    # ------------------------------------------------------------------------------------------- describing

    def to_dict(self) -> Dict[str, object]:
        """The contract as ``/info`` shows it."""
        out: Dict[str, object] = {
            "inputs": [{"name": s.name, "dtype": s.dtype, "shape": ["batch", *self.request_sizes(s)] if self.batched
                        else list(self.request_sizes(s))} for s in self.inputs],
            "batched": self.batched,
            "outputs": [{"name": o.name, "shape": o.written_shape(self.any_samples), "dtype": o.dtype}
                        for o in self.outputs],
            "content_types": self.content_types,
            "max_request_batch": self.max_request_batch,
            "max_body_bytes": self.max_body_bytes,
        }
        if self.preprocess is not None:
            out["preprocess"] = self.preprocess.to_dict()
        if self.image_size is not None:
            out["image"] = dict(zip(("height", "width", "channels"), self.image_size))
        if self.labels:
            out["labels"] = len(self.labels)
        return out


def _refuse_non_finite(spec: LeafSpec, array: np.ndarray) -> None:
    if spec.dtype.startswith("float") and array.size and not np.isfinite(array).all():
        count = int((~np.isfinite(array)).sum())
        raise BadRequest(422, f"input {spec.name!r}: {count} NaN or infinite value(s); the model takes finite "
                              f"{spec.dtype}")


def parse_json(body: bytes, what: str) -> Any:
    """``body`` as JSON, or a 400 naming ``what`` was malformed."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(400, f"malformed {what}: {exc}") from None
    except RecursionError:
        raise BadRequest(400, f"malformed {what}: nested too deeply") from None


def top_k_labels(scores: np.ndarray, labels: Sequence[str], k: int) -> List[List[Dict[str, Union[int, str, float]]]]:
    """Per row of class scores: the ``k`` best classes with their label and softmax probability."""
    shifted = scores.astype(np.float64) - scores.max(axis=1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    best = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return [[{"index": int(i), "label": labels[int(i)], "probability": float(row[i])} for i in idx]
            for idx, row in zip(best, probs)]


def _top_k(value: Any, key: str) -> Optional[int]:
    if value is None:
        return None
    try:
        k = int(value)
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()) or k < 0:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(422, f"{key}: expected a non-negative integer, got {value!r}") from None
    return k
