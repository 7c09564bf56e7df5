"""Python-backend models of a Triton repository: any artifact of an export (``aoti``, ``pt2``, their variants, the
export's selection) served by Triton's Python backend through the export's own checked loader, the same one
``fx-lightning serve`` runs (sha256 of every file, then the artifact on ``check.pt`` before the model reports
ready; a failing self-check fails the model's load).

Each such model's version directory holds ``model.py`` (:data:`MODEL_PY`: it delegates to :class:`ExportRunner`)
and ``export/``: the manifest, ``check.pt`` and the artifact's files (the whole export for the selection, whose
artifact is picked on the serving machine as ``load_fused`` picks it). Tensors cross between Triton and torch by
DLPack, never through numpy (with numpy 2 the Python backend's numpy path returned another input's data). The
server's Python environment needs torch and fx-lightning (what trained the model, or ``pip install fx-lightning``
with the extras of the artifact's format); Triton's Python backend runs the stub of that Python version.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from fx_lightning.config import Strategy
from fx_lightning.errors import ExportError
from fx_lightning.export.manifest import Manifest, read_manifest
from fx_lightning.common.rows import concat_rows, same_shape_groups, split_rows
from fx_lightning.serve.artifact import ServeOptions, load_checked
from fx_lightning.serve.contract import Contract
from fx_lightning.signature.absent import stand_in
from fx_lightning.signature.signature import LeafSpec

__all__ = ["MODEL_PY", "ENTRY_PARAMETER", "STRATEGY_PARAMETER", "ExportRunner", "python_copies",
           "selection_options"]

ENTRY_PARAMETER = "fx_lightning_entry"  # the config parameter naming the artifact; absent: the export's selection
# The selection's strategy, written when the model's batching came from the export's sweep: the selection is then
# its max-throughput pick, whose batching it is (as ``fx-lightning serve`` serves it); absent: the fastest for
# the model's max_batch_size.
STRATEGY_PARAMETER = "fx_lightning_strategy"

MODEL_PY = '''"""Triton Python-backend model written by fx-lightning: serves ./export with its checked loader."""

import json
import os

import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

from fx_lightning.serve.triton_python import ENTRY_PARAMETER, STRATEGY_PARAMETER, ExportRunner


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        folder = os.path.join(args["model_repository"], args["model_version"], "export")
        self.runner = ExportRunner(folder, parameters.get(ENTRY_PARAMETER), int(config.get("max_batch_size", 0)),
                                   parameters.get(STRATEGY_PARAMETER))

    def execute(self, requests):
        given = [[pb_utils.get_input_tensor_by_name(r, name) for name in self.runner.input_names] for r in requests]
        calls = [[None if t is None else from_dlpack(t.to_dlpack()) for t in call] for call in given]  # None: left out
        try:
            answers = self.runner.run(calls)
        except Exception as exc:  # every request of the batch gets the error, and the model keeps serving
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}"))
                    for _ in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(name, to_dlpack(t.contiguous()))
                                            for name, t in zip(self.runner.output_names, outputs)])
                for outputs in answers]
'''


class ExportRunner:
    """The artifact ``entry`` of the export in ``folder`` (None: the export's selection for ``max_batch_size``, or
    its max-throughput pick with ``strategy`` ``max_throughput``), loaded and self-checked; runs the requests Triton
    hands over, joining those of one shape along the sample axis when the model batches (``max_batch_size`` > 0)."""

    def __init__(self, folder: Any, entry: Optional[str], max_batch_size: int,
                 strategy: Optional[str] = None) -> None:
        contract = Contract.of(read_manifest(folder))
        self.batched = contract.batched and max_batch_size > 0
        self.module, self.status = load_checked(folder, selection_options(entry, max_batch_size, strategy))
        self.inputs = list(contract.inputs)
        self.output_names = [o.name for o in contract.outputs]

    @property
    def input_names(self) -> List[str]:
        return [s.name for s in self.inputs]

    def run(self, calls: Sequence[Sequence[Optional[torch.Tensor]]]) -> List[List[torch.Tensor]]:
        """Each call's outputs (one tensor per output, in order). None: an input the request left out, which the
        config marks optional: its proven stand-in, made for that call (before calls are joined)."""
        calls = [[t if t is not None else self._stand_in(spec, call) for spec, t in zip(self.inputs, call)]
                 for call in calls]
        with torch.no_grad():
            if not self.batched:
                return [self._outputs(call) for call in calls]
            answers: List[List[torch.Tensor]] = [[] for _ in calls]
            for places in same_shape_groups(calls):
                outputs = self._outputs(concat_rows([calls[i] for i in places], [0] * len(self.input_names)))
                for i, rows in zip(places, split_rows(outputs, [int(calls[i][0].shape[0]) for i in places])):
                    answers[i] = rows
            return answers

    def _stand_in(self, spec: LeafSpec, call: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        if not spec.optional:  # Triton refuses a request without a required input: a caller of run() left it out
            raise ExportError(f"input {spec.name!r} was left out, and no stand-in is proven for it")
        return stand_in(self.inputs, spec, call)

    def _outputs(self, args: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        out = self.module(*args)
        flat = list(out) if isinstance(out, (list, tuple)) else [out]
        if len(flat) != len(self.output_names) or not all(isinstance(t, torch.Tensor) for t in flat):
            raise ExportError(f"the artifact returned {len(flat)} outputs, the export names {self.output_names}")
        return flat


def python_copies(manifest: Manifest, entry: Optional[str]) -> List[str]:
    """The export's files a Python-backend model copies into ``export/``: the artifact's files and ``check.pt``
    (every file for the selection: its artifact is picked on the serving machine)."""
    if entry is None:
        return sorted(manifest.files)
    files = list(manifest.formats[entry].files)
    if manifest.check_file is not None:
        files.append(manifest.check_file)
    return files


def selection_options(entry: Optional[str], max_batch_size: int, strategy: Optional[str]) -> ServeOptions:
    """The serve options a Python-backend model loads its artifact by: ``entry``, else the export's selection for
    ``max_batch_size``, or (``strategy`` ``max_throughput``) the max-throughput pick whose sweep gave the batching."""
    swept = entry is None and strategy == Strategy.max_throughput.value
    return ServeOptions(format=entry or None, max_batch_size=None if swept else max(1, max_batch_size))
