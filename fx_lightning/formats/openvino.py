"""``openvino``: OpenVINO IR (``model.xml`` + ``model.bin``), run by OpenVINO's CPU runtime.

Converted from the fused model's ``torch.export`` program (OpenVINO's PyTorch frontend; TorchScript tracing as
the fallback), saved with fp32 weights (``ov.save_model`` would halve them to fp16 by default), with the batch
axis dynamic and every other axis fixed to the example's. Compiled for inference in fp32 (OpenVINO picks bf16
on CPUs that have it unless told), latency hint, as many threads as torch uses; the loaded module compiles one
static-shape copy per input shape it meets (a few to tens of milliseconds each, a handful kept), which ran
faster than the dynamic-shape model where measured (docs/performance.md). Optional extra:
``pip install 'fx-lightning[openvino]'``.

In C++: ``ov::Core core; auto compiled = core.compile_model("openvino/model.xml", "CPU");``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Mapping, NoReturn, Optional, Tuple, Union

import torch
from torch import nn

from fx_lightning.common.json_views import JsonObject
from fx_lightning.errors import ExportError, first_line
from fx_lightning.formats.base import (RUNTIME_DEFAULTS, Format, FormatEntry, VariantRequest, WriteContext,
                                       numpy_inputs, quietly)

__all__ = ["FORMAT", "OpenVinoModule", "COMPILE_CONFIG", "THREADS"]

# What the artifact is checked and served with. f32 keeps the fused model's numbers (bf16-capable CPUs would
# otherwise run bf16); threads are set at load time to torch's count in that process.
COMPILE_CONFIG = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
# The compile config key of the threads; recorded by the writer, a loaded model takes its own process's torch count.
THREADS = "INFERENCE_NUM_THREADS"
# Static-shape compiled copies kept per loaded module (least recently used dropped first): a server runs up to
# 7 shapes (batch 1, 2, 4... 64; fx_lightning.serve.artifact.serving_batch_sizes).
MAX_SHAPES = 8


def _convert(ctx: WriteContext) -> Tuple[Any, str, Optional[str]]:
    """The OpenVINO model, the route that converted it, and why the first route failed (None: it did not)."""
    import openvino as ov

    from fx_lightning.formats.pt2 import export_program

    try:
        with torch.no_grad():
            program = export_program(ctx)
        with quietly():
            return ov.convert_model(program), "torch.export", None
    except Exception as exc:  # noqa: BLE001 - TorchScript tracing handles some graphs the FX frontend cannot
        reason = f"{type(exc).__name__}: {first_line(exc)}"
    tensors = tuple(a for a in ctx.args if isinstance(a, torch.Tensor))
    try:
        with torch.no_grad(), quietly():
            return ov.convert_model(ctx.model, example_input=tensors), "torchscript", reason
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"OpenVINO could not convert the model: torch.export route: {reason}; "
                          f"TorchScript route: {type(exc).__name__}: {first_line(exc)}") from exc


def _input_shapes(ctx: WriteContext) -> List[List[int]]:
    """Each tensor input's shape for the IR: the example's, with -1 (any) on the dimensions that are dynamic (the
    sample axis, the sizes that vary)."""
    tensors = [a for a in ctx.args if isinstance(a, torch.Tensor)]
    dims = ctx.leaf_dims or [None] * len(tensors)
    return [[-1 if spec and d in spec else int(size) for d, size in enumerate(arg.shape)]
            for arg, spec in zip(tensors, dims)]


def _write(root: Path, ctx: WriteContext) -> FormatEntry:
    import openvino as ov

    model, route, fallback_reason = _convert(ctx)
    shapes = _input_shapes(ctx)
    if len(model.inputs) != len(shapes):
        raise ExportError(f"the OpenVINO model takes {len(model.inputs)} inputs, "
                          f"the fused model {len(shapes)} tensors.")
    model.reshape({port: ov.PartialShape(shape) for port, shape in zip(model.inputs, shapes)})
    folder = root / FORMAT.path
    folder.mkdir()
    ov.save_model(model, str(folder / "model.xml"), compress_to_fp16=False)  # fp16 weights would break parity
    options: JsonObject = {
        "converted_from": route,
        "input_shapes": shapes,  # -1: any size
        "compile_config": {**COMPILE_CONFIG, THREADS: torch.get_num_threads()},
        "built_with": {"openvino": ov.__version__},
    }
    if fallback_reason:
        options["export_failure"] = fallback_reason
    return FormatEntry(FORMAT.path, "openvino.Core().compile_model(path + '/model.xml', 'CPU', compile_config)",
                       device="cpu", options=options)


def _make_variant(root: Path, entry: FormatEntry, request: VariantRequest) -> Optional[FormatEntry]:
    """bf16: the fp32 IR compiled with OpenVINO's bf16 inference precision (the same files). int8: NNCF's
    post-training quantisation of the fp32 IR (``nncf.quantize``, its defaults) on the calibration inputs,
    saved in the variant's folder; the layers NNCF keeps in int8 run int8, the others in fp32."""
    config = {**(entry.options.get("compile_config") or COMPILE_CONFIG)}
    if request.precision == "bf16":
        config["INFERENCE_PRECISION_HINT"] = "bf16"
        return dataclasses.replace(entry, options={**entry.options, "compile_config": config})
    if request.precision != "int8":
        return None
    try:
        import nncf
    except ImportError as exc:
        raise ExportError(f"OpenVINO int8 needs NNCF: pip install 'fx-lightning[int8]' ({exc})") from None
    import openvino as ov

    model = ov.Core().read_model(str(root / entry.path / "model.xml"))
    dataset = nncf.Dataset(request.calibration, _numpy_inputs)
    with quietly():
        nncf.set_log_level(40)  # ERROR: its progress bars and INFO lines are not the user's business
        quantized = nncf.quantize(model, dataset, subset_size=max(1, sum(_samples(b) for b in request.calibration)))
    folder = root / request.folder / FORMAT.path
    folder.mkdir(parents=True)
    ov.save_model(quantized, str(folder / "model.xml"), compress_to_fp16=False)
    return FormatEntry(f"{request.folder}/{FORMAT.path}", entry.loader, device="cpu",
                       options={**entry.options, "compile_config": config,
                                "quantized_with": {"nncf": nncf.__version__, "calibration_batches": len(request.calibration)}})


def _numpy_inputs(batch: tuple) -> Any:
    arrays = numpy_inputs(batch)
    return arrays[0] if len(arrays) == 1 else tuple(arrays)


def _samples(batch: tuple) -> int:
    return next((int(t.shape[0]) for t in batch if isinstance(t, torch.Tensor) and t.dim()), 1)


class OpenVinoModule(nn.Module):
    """An OpenVINO model behind the nn.Module interface: tensors in, CPU tensors out.

    ``config``: the compile config as given (None: :data:`COMPILE_CONFIG`); ``threads``: its
    ``INFERENCE_NUM_THREADS`` (None: torch's count in this process; 0: not set, OpenVINO's own default).
    Each new combination of input shapes gets its own compiled copy with those shapes fixed (the ``MAX_SHAPES``
    most recent are kept); shapes the IR cannot take statically run on one compiled model that takes every shape."""

    def __init__(self, xml_path: Any, config: Optional[Mapping[str, Union[str, int]]] = None,
                 threads: Optional[int] = None) -> None:
        super().__init__()
        import openvino as ov

        self.path = str(xml_path)
        self.core = ov.Core()
        self.model = self.core.read_model(self.path)
        given = COMPILE_CONFIG if config is None else config
        self.config: Dict[str, Union[str, int]] = {k: v for k, v in given.items() if k != THREADS}
        if threads != 0:
            self.config[THREADS] = int(threads or torch.get_num_threads())
        self.compiled: "OrderedDict[Any, Any]" = OrderedDict()
        self.dynamic: Any = None  # compiled on first need: a second copy of the weights otherwise
        self.eval()

    def _request(self, shapes: Tuple[Tuple[int, ...], ...]) -> Any:
        if shapes in self.compiled:
            self.compiled.move_to_end(shapes)
            return self.compiled[shapes]
        import openvino as ov

        model = self.model.clone()
        try:
            model.reshape({port: ov.PartialShape(list(s)) for port, s in zip(model.inputs, shapes)})
            compiled = self.core.compile_model(model, "CPU", self.config)
        except RuntimeError:  # shapes the IR cannot take statically: the dynamic model says why, if it must
            if self.dynamic is None:
                self.dynamic = self.core.compile_model(self.model, "CPU", self.config)
            return self.dynamic
        self.compiled[shapes] = compiled
        if len(self.compiled) > MAX_SHAPES:
            self.compiled.popitem(last=False)
        return compiled

    def forward(self, *args: Any) -> Any:
        arrays = numpy_inputs(args)
        if len(arrays) != len(self.model.inputs):
            raise ValueError(f"the OpenVINO model takes {len(self.model.inputs)} tensor inputs, got {len(arrays)}.")
        compiled = self._request(tuple(tuple(a.shape) for a in arrays))
        results = compiled(arrays, share_inputs=True, share_outputs=False)
        outs = [torch.from_numpy(results[port]) for port in compiled.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __getstate__(self) -> NoReturn:
        raise TypeError("OpenVinoModule wraps compiled OpenVINO models and cannot be pickled; load it again.")


def _load(root: Path, entry: FormatEntry, device: torch.device) -> nn.Module:
    if device.type != "cpu":
        raise ExportError(f"format 'openvino' runs on the CPU here (OpenVINO's CPU runtime), not on {device}; "
                          "load it with device='cpu'.")
    import openvino as ov

    recorded = entry.options.get("compile_config") or COMPILE_CONFIG
    # Recorded threads (the writer's count) become this process's; none recorded: OpenVINO's own default. Every
    # entry written records them; the runtime choice RUNTIME_DEFAULTS removes them.
    threads = None if THREADS in recorded or recorded is COMPILE_CONFIG else 0
    try:
        return OpenVinoModule(root / entry.path / "model.xml", recorded, threads)
    except RuntimeError as exc:
        built = (entry.options.get("built_with") or {}).get("openvino", "unknown")
        raise ExportError(f"format 'openvino': OpenVINO {ov.__version__} cannot read or compile the IR written by "
                          f"OpenVINO {built}: {first_line(exc)}") from exc


FORMAT = Format(
    name="openvino",
    path="openvino",
    write=_write,
    load=_load,
    preference=45,
    requires=("openvino",),
    runtime_requires=("openvino",),
    install_hint="pip install 'fx-lightning[openvino]' (openvino)",
    variants={"int8": _make_variant, "bf16": _make_variant},
    # OpenVINO's own defaults (``compile_model(path, "CPU")``: its performance hint and threads) beside ours; the
    # precision stays the one the artifact was checked at (a bf16-capable CPU would otherwise run fp32 IR in bf16:
    # that is the openvino-bf16 variant, raced with its own defaults too).
    runtime_choices={RUNTIME_DEFAULTS: {"compile_config": {"PERFORMANCE_HINT": None, THREADS: None}}},
    readme=(
        "- `{path}/` (openvino): OpenVINO IR, `openvino.Core().compile_model('{path}/model.xml', 'CPU', "
        "{{'INFERENCE_PRECISION_HINT': 'f32'}})`; `ov::Core().compile_model(...)` in C++. "
        "Dynamic batch axis; XML graph and raw weights, no code."
    ),
    triton_backend="openvino",
)
