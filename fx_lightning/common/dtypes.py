"""Data types, named once: every tensor dtype the package meets, with what torch, numpy, ONNX, OpenVINO, Triton and
the Open Inference Protocol call it, and the other names people write on a command line. The lookups below are
derived from this one table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = ["DType", "DTYPES", "BY_TORCH", "BY_NAME", "TORCH_TO_TRITON", "ONNX_TO_TORCH", "OPENVINO_TO_TORCH"]


@dataclass(frozen=True)
class DType:
    torch: str  # torch's name, as manifests record it ("float32")
    numpy: str  # numpy's (what a server decodes into; bfloat16 has none: float32 stands in)
    triton: str  # Triton's model_config DataType ("TYPE_FP32")
    v2: str  # the Open Inference Protocol's datatype ("FP32")
    onnx: Optional[str] = None  # ONNX TensorProto.DataType name ("FLOAT")
    openvino: Optional[str] = None  # OpenVINO element type ("f32"); None: its Triton backend has none
    aliases: Tuple[str, ...] = ()  # other names a user may write ("float", "double", "long"...)


DTYPES: Tuple[DType, ...] = (
    DType("float32", "float32", "TYPE_FP32", "FP32", "FLOAT", "f32", ("float",)),
    DType("float16", "float16", "TYPE_FP16", "FP16", "FLOAT16", "f16", ("half",)),
    DType("bfloat16", "float32", "TYPE_BF16", "BF16", "BFLOAT16", None),
    DType("float64", "float64", "TYPE_FP64", "FP64", "DOUBLE", None, ("double",)),
    DType("uint8", "uint8", "TYPE_UINT8", "UINT8", "UINT8", "u8"),
    DType("int8", "int8", "TYPE_INT8", "INT8", "INT8", "i8"),
    DType("uint16", "uint16", "TYPE_UINT16", "UINT16", "UINT16", "u16"),
    DType("int16", "int16", "TYPE_INT16", "INT16", "INT16", "i16"),
    DType("uint32", "uint32", "TYPE_UINT32", "UINT32", "UINT32", "u32"),
    DType("int32", "int32", "TYPE_INT32", "INT32", "INT32", "i32", ("int",)),
    DType("uint64", "uint64", "TYPE_UINT64", "UINT64", "UINT64", "u64"),
    DType("int64", "int64", "TYPE_INT64", "INT64", "INT64", "i64", ("long",)),
    DType("bool", "bool", "TYPE_BOOL", "BOOL", "BOOL", "boolean"),
)

BY_TORCH: Dict[str, DType] = {d.torch: d for d in DTYPES}  # by torch's name ("float32")
# By what a user names: torch's name or an alias ("float", "double", "half", "int", "long").
BY_NAME: Dict[str, DType] = {**{a: d for d in DTYPES for a in d.aliases}, **BY_TORCH}

TORCH_TO_TRITON: Dict[str, str] = {d.torch: d.triton for d in DTYPES}
# An artifact's tensor types as torch names (OpenVINO's Triton backend has no bf16 and no f64).
ONNX_TO_TORCH: Dict[str, str] = {d.onnx: d.torch for d in DTYPES if d.onnx}
OPENVINO_TO_TORCH: Dict[str, str] = {d.openvino: d.torch for d in DTYPES if d.openvino}
