"""Serve an fx-lightning export: load the fused model and run a batch, without the training code.

    python examples/serve.py path/to/fx_fused                    # the selected artifact, random batch of 4
    python examples/serve.py path/to/fx_fused --format onnx --batch-size 7
    python examples/serve.py path/to/fx_fused --format aoti-int8 --batch-size 8
    python examples/serve.py path/to/fx_fused --input batch.pt --save out.pt

Only torch is needed (onnxruntime for ONNX, openvino for OpenVINO IR, torchao for an int8 variant).
fx-lightning is used when installed (it verifies each file's sha256 against the manifest and refuses an
AOTInductor package built for another CPU or torch); without it the plain torch loaders below do the same
job. The default artifact is the one the export selected as the fastest that passed its check
(``export.select: fastest`` or ``fx-lightning bench --select``), else the first by preference. Nothing here
imports the code that trained the model: the export carries the graph and the weights.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Dict, List

import torch

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


def load(directory: str, fmt: str | None = None) -> torch.nn.Module:
    """The fused model: fx_lightning.load_fused when installed, else torch's own loaders."""
    try:
        from fx_lightning import load_fused
    except ImportError:
        return _load_with_torch(directory, fmt)
    return load_fused(directory, fmt)


PREFERENCE = ("pt2", "graph_module", "code", "onnx", "openvino", "aoti")


def _load_with_torch(directory: str, fmt: str | None) -> torch.nn.Module:
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    formats = manifest["formats"]
    selected = (manifest.get("selected") or {}).get("format")
    name = fmt or (selected if selected in formats else next(f for f in PREFERENCE if f in formats))
    if name not in formats:
        raise SystemExit(f"format {name!r} is not in this export (it has {', '.join(formats)})")
    entry = dict(formats[name])
    if fmt is None and name == selected:  # the runtime settings that made it fastest (ONNX Runtime spinning, say)
        entry = _merged(entry, (manifest.get("selected") or {}).get("runtime_options") or {})
    for module in entry.get("imports", []):  # e.g. torchao: registers the int8 ops of a variant
        importlib.import_module(module)
    path = os.path.join(directory, entry["path"])
    kind = entry.get("format", name)  # a variant (pt2-int8) says which format it is written in
    if kind == "pt2":
        return torch.export.load(path).module()
    if kind == "aoti":
        runners = {size: torch._inductor.aoti_load_package(os.path.join(path, package))
                   for size, package in entry["packages"].items()}

        def run_aoti(*xs: torch.Tensor) -> Any:
            runner = runners.get(str(xs[0].shape[0])) or runners.get("dynamic")
            if runner is None:
                raise SystemExit(f"the packages are compiled for batch sizes {sorted(runners)}; got {xs[0].shape[0]}")
            return runner(*xs)

        return run_aoti  # type: ignore[return-value]
    if kind == "graph_module":
        # Pickled code: weights_only=False executes it. Load only exports you trust.
        return torch.load(path, weights_only=False).eval()
    if kind == "code":
        for mod in [m for m in sys.modules if m == "fused_module" or m.startswith("fused_module.")]:
            del sys.modules[mod]  # another export's package, imported earlier in this process
        sys.path.insert(0, directory)
        try:
            from fused_module import load as load_code  # the generated package inside the export
        finally:
            sys.path.remove(directory)
        return load_code()
    if kind == "onnx":
        import onnxruntime as ort

        recorded = entry.get("session_options") or {}  # as the export checked it (threads: this machine's)
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel,
                                                   recorded.get("graph_optimization_level", "ORT_ENABLE_ALL"))
        for key, value in (recorded.get("config_entries") or {}).items():
            options.add_session_config_entry(key, str(value))
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]

        def run(*xs: torch.Tensor) -> Any:
            outs = session.run(None, {n: x.numpy() for n, x in zip(names, xs)})
            return torch.from_numpy(outs[0]) if len(outs) == 1 else tuple(torch.from_numpy(o) for o in outs)

        return run  # type: ignore[return-value]
    if kind == "openvino":
        import openvino as ov

        config = {k: v for k, v in (entry.get("compile_config") or {}).items() if k != "INFERENCE_NUM_THREADS"}
        compiled = ov.Core().compile_model(os.path.join(path, "model.xml"), "CPU",
                                           {"INFERENCE_PRECISION_HINT": "f32", **config})

        def run_openvino(*xs: torch.Tensor) -> Any:
            result = compiled([x.numpy() for x in xs])
            outs = [torch.from_numpy(result[port]) for port in compiled.outputs]
            return outs[0] if len(outs) == 1 else tuple(outs)

        return run_openvino  # type: ignore[return-value]
    raise SystemExit(f"unknown format {kind!r}")


def _merged(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def random_inputs(manifest: Dict[str, Any], batch_size: int, seed: int = 0) -> List[torch.Tensor]:
    """Inputs shaped as the manifest says, with ``batch`` replaced by ``batch_size``."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for spec in manifest["inputs"]:
        if spec.get("kind", "tensor") != "tensor":
            raise SystemExit(f"input {spec['name']!r} is not a tensor; pass --input")
        shape = [batch_size if d == "batch" else int(d) for d in spec["shape"]]
        dtype = _DTYPES.get(spec["dtype"], torch.float32)
        high = 256 if dtype == torch.uint8 else 2  # uint8: raw pixels (export.preprocess)
        x = torch.randn(shape, generator=g) if dtype.is_floating_point else torch.randint(0, high, shape, generator=g)
        xs.append(x.to(dtype))
    return xs


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="the export directory (holds manifest.json)")
    parser.add_argument("--format", default=None,
                        help="an artifact of the export: pt2, graph_module, code, onnx, openvino, aoti, "
                             "pt2-int8, aoti-int8...")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--input", help="a .pt file with a tensor (or a list of tensors) to run instead of random data")
    parser.add_argument("--save", help="write {'inputs': [...], 'output': ...} to this .pt file")
    args = parser.parse_args(argv)

    with open(os.path.join(args.directory, "manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    model = load(args.directory, args.format)
    if args.input:
        loaded = torch.load(args.input, weights_only=True)
        inputs = list(loaded) if isinstance(loaded, (list, tuple)) else [loaded]
    else:
        inputs = random_inputs(manifest, args.batch_size)
    with torch.no_grad():
        output = model(*inputs)
    first = output if isinstance(output, torch.Tensor) else output[0]
    parity = manifest.get("parity") or {}
    chosen = args.format or (manifest.get("selected") or {}).get("format") or "first by preference"
    print(f"loaded {args.directory} ({chosen}; parity passed: {parity.get('passed')})")
    print(f"inputs {[tuple(x.shape) for x in inputs]} -> output {tuple(first.shape)} {str(first.dtype)}")
    if args.save:
        torch.save({"inputs": inputs, "output": output}, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
