"""The light subset of the third-party matrix (``benchmarks/third_party.py``, docs/third-party-matrix.md): the
libraries of the matrix that the ``dev`` extra installs anyway (timm, segmentation_models_pytorch, transformers),
each trained as its docs train it with ``FXFuseCallback()`` and nothing else, then checked independently of the
callback: ``load_fused(export_dir)`` against an fp64 copy of the fused submodule on held-out calls the library's own
code makes (sizes never seen in training, batch 1, its predict call). The whole matrix (16 libraries, their own
virtual environment) runs with ``python benchmarks/third_party.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("library", ["timm", "segmentation_models_pytorch", "transformers"])
def test_a_library_of_the_matrix_works_with_the_callback_alone(library: str, tmp_path: Path) -> None:
    pytest.importorskip(library)
    out = tmp_path / "matrix"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "third_party.py"), "--only", library,
                          "--python", sys.executable, "--out", str(out), "--timeout", "600"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = json.loads(out.with_suffix(".json").read_text())["results"]
    assert result["outcome"] == "works", (result["outcome"], result.get("reason"), result.get("error"))
    assert result["callback_is_ours"] and result["export_under_root"], result
    checked = [c for c in result["calls"] if "rel_err" in c]
    assert checked and all(c["rel_err"] < 1e-4 for c in checked), checked
    assert any("=(1," in c["inputs"] for c in result["calls"]), \
        "no held-out call at batch 1"
