"""Helpers for the export and CLI tests: non-trivial BatchNorms, fp64 references, file snapshots, and a
fresh Python process that cannot see the repository's tests/ or examples/ (the "training code")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from fusion_helpers import file_hashes as snapshot  # noqa: F401  (re-exported for the export tests)
from fusion_helpers import randomize_batchnorms, reference_fp64, rel_err  # noqa: F401

REPO = Path(__file__).resolve().parents[1]










def leftovers(parent: Path, name: str) -> list:
    """Temporary or moved-aside siblings an export may have left next to ``parent/name``."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def clean_env() -> Dict[str, str]:
    """The environment without PYTHONPATH (and friends), one thread: a serving process's view."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["OMP_NUM_THREADS"] = "1"
    return env


# Runs inside the fresh process. It refuses to start if the repository's tests/ or examples/ (or the
# repository root, which would expose them as packages) are importable, loads every requested export,
# runs the given inputs and saves the outputs; then checks that no module was imported from those folders.
SERVE_CHECK = textwrap.dedent(
    '''
    import importlib.util, json, os, sys, traceback
    repo, job_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    forbidden = [os.path.join(repo, "tests"), os.path.join(repo, "examples")]
    for entry in sys.path:
        full = os.path.abspath(entry or os.getcwd())
        assert full != repo and not any(full.startswith(f) for f in forbidden), f"training code on sys.path: {full}"
    for name in ("test_export", "export_helpers", "test_cli", "conftest"):
        assert importlib.util.find_spec(name) is None, f"{name} is importable"
    import torch
    torch.set_num_threads(1)
    job = torch.load(job_path, weights_only=True)
    results, errors = {}, {}
    for key, spec in json.loads(job["spec"]).items():
        try:
            if spec["loader"] == "load_fused":
                from fx_lightning import load_fused
                model = load_fused(spec["dir"], spec["format"])
            elif spec["loader"] == "torch.export":
                model = torch.export.load(os.path.join(spec["dir"], "model.pt2")).module()
            elif spec["loader"] == "torch.load":
                model = torch.load(os.path.join(spec["dir"], "model.pt"), weights_only=False).eval()
            elif spec["loader"] == "code":
                sys.path.insert(0, spec["dir"])
                from fused_module import load
                model = load()
                sys.path.remove(spec["dir"])
                sys.modules.pop("fused_module", None); sys.modules.pop("fused_module.module", None)
            elif spec["loader"] == "onnxruntime":
                import onnxruntime as ort
                sess = ort.InferenceSession(os.path.join(spec["dir"], "model.onnx"), providers=["CPUExecutionProvider"])
                name = sess.get_inputs()[0].name
                model = lambda x: torch.from_numpy(sess.run(None, {name: x.numpy()})[0])
            elif spec["loader"] == "openvino":
                import openvino as ov
                compiled = ov.Core().compile_model(os.path.join(spec["dir"], "openvino", "model.xml"), "CPU",
                                                   {"INFERENCE_PRECISION_HINT": "f32"})
                model = lambda x, c=compiled: torch.from_numpy(c([x.numpy()])[c.outputs[0]])
            else:
                raise ValueError(spec["loader"])
            with torch.no_grad():
                results[key] = [model(x) for x in job["inputs"]]
        except Exception:
            errors[key] = traceback.format_exc()
    bad = sorted({getattr(m, "__file__", None) for m in list(sys.modules.values())
                  if getattr(m, "__file__", None) and any(os.path.abspath(m.__file__).startswith(f) for f in forbidden)})
    torch.save({"results": results, "errors": json.dumps(errors), "bad_imports": json.dumps(bad)}, out_path)
    '''
)


def run_fresh(
    tmp: Path, specs: Dict[str, Dict[str, Any]], inputs: Sequence[torch.Tensor], timeout: float = 240
) -> Dict[str, Any]:
    """Load each export of ``specs`` (key -> {dir, format, loader}) in one fresh ``python -I`` process,
    with ``cwd`` outside the repository and no PYTHONPATH; return its outputs for ``inputs``."""
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "serve_check.py"
    script.write_text(SERVE_CHECK)
    job = tmp / "job.pt"
    torch.save({"spec": json.dumps(specs), "inputs": list(inputs)}, job)
    out = tmp / "out.pt"
    proc = subprocess.run(
        [sys.executable, "-I", str(script), str(REPO), str(job), str(out)],
        cwd=tmp, env=clean_env(), capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"fresh process failed:\n{proc.stdout}\n{proc.stderr}"
    data = torch.load(out, weights_only=True)
    return {
        "results": data["results"],
        "errors": json.loads(data["errors"]),
        "bad_imports": json.loads(data["bad_imports"]),
    }


def run_script(args: Sequence[str], cwd: Path, timeout: float = 240, check: bool = True,
               env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``python -I args...`` in ``cwd`` with a clean environment."""
    proc = subprocess.run([sys.executable, "-I", *args], cwd=cwd, env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_export_worker(rank: int, world: int, tmp: str, port: int) -> None:
    """One rank of the DDP export test (gloo on CPU): every rank calls export_fused; only rank zero writes."""
    import dataclasses

    import torch.distributed as dist

    from fx_lightning import fuse
    from fx_lightning.config import load_config
    from fx_lightning.export import FORMATS, export_fused

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    writes = []
    real_write = FORMATS["graph_module"].write

    def counting(root, ctx):  # records which rank actually writes
        writes.append(str(root))
        return real_write(root, ctx)

    FORMATS["graph_module"] = dataclasses.replace(FORMATS["graph_module"], write=counting)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        root = Path(tmp)
        model = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
        x = torch.randn(2, 3, 6, 6)
        gm = fuse(model, example_inputs=x).graph_module
        cfg = load_config({"export": {"formats": ["graph_module"], "overwrite": False}})
        target = root / "exp"
        out = export_fused(gm, target, example_inputs=(x,), config=cfg)
        result: Dict[str, Any] = {"wrote": bool(writes), "returned": str(out)}
        dist.barrier()  # the caller's own synchronisation (the callback broadcasts rank zero's result)
        result["saw_manifest_after_barrier"] = (out / "manifest.json").is_file()
        (root / f"rank_{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
