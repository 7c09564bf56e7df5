"""``onnx``: ONNX with a dynamic batch axis (``torch.onnx``, dynamo exporter, TorchScript as the fallback),
checked with ONNX Runtime when it is installed. Optional extra: ``pip install 'fx-lightning[onnx]'``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, NoReturn, Optional, Sequence

import torch
from torch import nn

from fx_lightning.common.json_views import JsonObject
from fx_lightning.common.batches import flat_tensors
from fx_lightning.errors import ExportError, first_line
from fx_lightning.formats.base import (RUNTIME_DEFAULTS, Format, FormatEntry, VariantRequest, WriteContext,
                                       numpy_inputs, quietly)
from fx_lightning.signature.signature import LeafSpec

__all__ = ["FORMAT", "OnnxRuntimeModule", "SESSION_LEVEL", "ORT_OWN_THREADS"]


def _write(root: Path, ctx: WriteContext) -> FormatEntry:
    path = root / FORMAT.path
    input_names = [n for n, a in zip(ctx.input_names, ctx.args) if isinstance(a, torch.Tensor)]
    with torch.no_grad():
        output_names = [f"output_{i}" for i in range(len(flat_tensors(ctx.model(*ctx.args))))]
    exporter = "dynamo"
    fallback_reason = None
    try:
        onnx_dynamo(ctx, path, input_names, output_names)
    except Exception as exc:  # noqa: BLE001 - the TorchScript exporter handles some graphs dynamo cannot
        fallback_reason = f"{type(exc).__name__}: {first_line(exc)}"
        for leftover in root.glob(FORMAT.path + "*"):
            leftover.unlink()
        exporter = "torchscript"
        try:
            onnx_torchscript(ctx, path, input_names, output_names)
        except Exception as exc2:  # noqa: BLE001
            raise ExportError(
                f"torch.onnx.export failed with both exporters: dynamo: {fallback_reason}; "
                f"torchscript: {type(exc2).__name__}: {first_line(exc2)}"
            ) from exc2
    import onnx

    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    options: JsonObject = {
        "exporter": exporter,
        "session_options": {"graph_optimization_level": SESSION_LEVEL, "intra_op_num_threads": torch.get_num_threads(),
                            "config_entries": dict(SESSION_CONFIG)},
        "opset": max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None),
        "input_names": [i.name for i in model.graph.input],
        "output_names": [o.name for o in model.graph.output],
    }
    if fallback_reason:
        options["dynamo_failure"] = fallback_reason
    # ONNX itself is device-free; the round-trip check runs it with ONNX Runtime on the CPU.
    return FormatEntry(FORMAT.path, "onnxruntime.InferenceSession(path)", device="cpu", options=options)


def onnx_dynamo(ctx: WriteContext, path: Path, input_names: List[str], output_names: List[str]) -> None:
    """torch.onnx's dynamo exporter, quietly (it reports its steps with print())."""
    with quietly():
        program = torch.onnx.export(ctx.export_model, ctx.args, dynamo=True, input_names=input_names,
                                    output_names=output_names, dynamic_shapes=ctx.export_dynamic_shapes, verbose=False,
                                    opset_version=ctx.onnx_opset)
        if program is None:
            raise ExportError("torch.onnx.export returned no program.")
        program.save(str(path))


def onnx_torchscript(ctx: WriteContext, path: Path, input_names: List[str], output_names: List[str]) -> None:
    """torch.onnx's TorchScript exporter, for graphs the dynamo exporter cannot handle."""
    dynamic_axes = None
    if ctx.dynamic:
        signature = ctx.exported_signature
        dynamic_axes = {n: _dynamic_axes(leaf, ctx) for n, leaf in zip(input_names, signature.inputs)}
        dynamic_axes.update({n: _dynamic_axes(leaf, ctx) for n, leaf in zip(output_names, signature.outputs)})
    with quietly():
        torch.onnx.export(ctx.model, ctx.args, str(path), dynamo=False, input_names=input_names,
                          output_names=output_names, dynamic_axes=dynamic_axes, opset_version=ctx.onnx_opset)


def _dynamic_axes(leaf: LeafSpec, ctx: WriteContext) -> Dict[int, str]:
    """The TorchScript exporter's dynamic axes of a leaf: the sample axis ``batch`` (when dynamic), each size that
    varies by its name."""
    return {d: token for d, token in enumerate(leaf.written_shape(ctx.sample_dynamic)) if isinstance(token, str)}


# How the artifact is checked, and run by load_fused: what an inference server uses (all graph optimisations,
# ONNX Runtime's default) with as many intra-op threads as torch uses in this process.
SESSION_LEVEL = "ORT_ENABLE_ALL"
# ONNX Runtime's intra-op threads spin between runs by default and take the cores from anything else in the
# process, and the session itself is no faster for it (figures: docs/performance.md). A server that also runs
# torch (pre-processing, other models) wants them off; so does a side-by-side benchmark.
SESSION_CONFIG = {"session.intra_op.allow_spinning": "0"}
# ``intra_op_num_threads`` recorded as this: ONNX Runtime sizes its own thread pool (its convention for "default");
# any other recorded count is the writer's, and a loaded session takes its own process's torch count instead.
ORT_OWN_THREADS = 0


class OnnxRuntimeModule(nn.Module):
    """An onnxruntime session behind the nn.Module interface: tensors in, tensors out (on ``device``). The session
    runs ``threads`` intra-op threads (None: torch's count in this process; :data:`ORT_OWN_THREADS`: ONNX Runtime's
    own default), graph optimisation ``level`` and the session ``config_entries`` (None: :data:`SESSION_CONFIG`)."""

    def __init__(self, path: Any, providers: Optional[Sequence[str]] = None, device: Any = "cpu",
                 threads: Optional[int] = None, level: str = SESSION_LEVEL,
                 config_entries: Optional[Dict[str, str]] = None) -> None:
        super().__init__()
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        options.intra_op_num_threads = torch.get_num_threads() if threads is None else threads
        for key, value in (SESSION_CONFIG if config_entries is None else config_entries).items():
            options.add_session_config_entry(key, str(value))
        self.path = str(path)
        self.device = torch.device(device)
        self.session = ort.InferenceSession(self.path, sess_options=options,
                                            providers=list(providers or ["CPUExecutionProvider"]))
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.eval()

    def forward(self, *args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) != len(self.input_names):
            raise ValueError(f"the ONNX model takes {len(self.input_names)} tensor inputs "
                             f"({', '.join(self.input_names)}), got {len(tensors)}.")
        feed = dict(zip(self.input_names, numpy_inputs(tensors)))
        outs = [torch.from_numpy(o).to(self.device) for o in self.session.run(None, feed)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __getstate__(self) -> NoReturn:
        raise TypeError("OnnxRuntimeModule wraps an onnxruntime session and cannot be pickled; load it again.")


def _load(root: Path, entry: FormatEntry, device: torch.device) -> nn.Module:
    import onnxruntime as ort

    provider = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}.get(device.type)
    available = ort.get_available_providers()
    if provider not in available:
        raise ExportError(
            f"format 'onnx' cannot run on {device}: ONNX Runtime here has {', '.join(available)}"
            + (" (install onnxruntime-gpu for CUDA)" if device.type == "cuda" else "") + "; load it with device='cpu'."
        )
    recorded = entry.options.get("session_options") or {}
    own = recorded.get("intra_op_num_threads") == ORT_OWN_THREADS  # the runtime's defaults (a runtime choice)
    return OnnxRuntimeModule(root / entry.path, [provider], device, threads=ORT_OWN_THREADS if own else None,
                             level=recorded.get("graph_optimization_level", SESSION_LEVEL),
                             config_entries=recorded.get("config_entries", SESSION_CONFIG))


def _make_variant(root: Path, entry: FormatEntry, request: VariantRequest) -> Optional[FormatEntry]:
    """int8: ONNX Runtime's static quantisation of the fp32 model in QDQ form (per-channel int8 weights, uint8
    activations, ONNX Runtime's defaults otherwise), calibrated on the calibration inputs."""
    if request.precision != "int8":
        return None
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    names = [str(n) for n in entry.options.get("input_names") or []]

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.feeds = (dict(zip(names, numpy_inputs(batch))) for batch in request.calibration)

        def get_next(self) -> Optional[Dict[str, Any]]:
            return next(self.feeds, None)

    folder = root / request.folder
    folder.mkdir(parents=True, exist_ok=True)
    prepared = folder / ".model.pre.onnx"
    with quietly():
        try:  # shape inference and graph optimisation first, as ONNX Runtime's quantisation guide asks
            quant_pre_process(str(root / entry.path), str(prepared))
            source = prepared
        except Exception:  # noqa: BLE001 - quantising the model as exported still works, a little slower
            source = root / entry.path
        quantize_static(str(source), str(folder / FORMAT.path), Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    prepared.unlink(missing_ok=True)
    import onnxruntime

    return FormatEntry(f"{request.folder}/{FORMAT.path}", entry.loader, device="cpu",
                       options={**entry.options, "quantized_with": {"onnxruntime": onnxruntime.__version__,
                                                                    "calibration_batches": len(request.calibration)}})


FORMAT = Format(
    name="onnx",
    path="model.onnx",
    write=_write,
    load=_load,
    preference=40,
    requires=("onnx", "onnxscript"),
    runtime_requires=("onnxruntime",),
    install_hint="pip install 'fx-lightning[onnx]' (onnx, onnxscript, onnxruntime)",
    variants={"int8": _make_variant},
    # Intra-op threads spinning between runs: slower for torch beside it in the process, but no wake-up cost for
    # a request after an idle gap; and ONNX Runtime's own defaults (``InferenceSession(path)``: its thread pool,
    # spinning on), what a user comparing with it gets. The selection times all on the machine at hand
    # (docs/performance.md).
    runtime_choices={"spinning": {"session_options": {"config_entries": {"session.intra_op.allow_spinning": "1"}}},
                     RUNTIME_DEFAULTS: {"session_options": {"intra_op_num_threads": ORT_OWN_THREADS, "config_entries": {
                         "session.intra_op.allow_spinning": None}}}},
    readme="- `{path}` (onnx): `onnxruntime.InferenceSession('{path}')`; dynamic batch axis.",
    triton_backend="onnxruntime",
)
