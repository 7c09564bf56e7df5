"""The pyfunc model MLflow loads: the export's artifact through the export's own checked loader (the sha256 of every
file, then ``check.pt``), called with tensors named and shaped as the export's signature says."""

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import mlflow
import numpy as np
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from fx_lightning.common.batches import flat_tensors
from fx_lightning.export.manifest import read_manifest
from fx_lightning.serve.artifact import load_checked
from fx_lightning.serve.contract import BadRequest, Contract
from fx_lightning.tracking.mlflow_export import EXPORT_ARTIFACT, FORMAT_KEY, pyfunc_serve_options

__all__ = ["FusedExportModel"]

Prediction = Union[np.ndarray, Dict[str, np.ndarray]]


class FusedExportModel(mlflow.pyfunc.PythonModel):
    """``predict`` takes one array per model input (a dict keyed by input name, or one array for a one-input model)
    with the sample axis first, and returns the output array (one output) or a dict of them keyed by output name.
    ``model_config``: ``format`` (null: the export's selection)."""

    def load_context(self, context: Any) -> None:
        config = dict(context.model_config or {})
        directory = Path(context.artifacts[EXPORT_ARTIFACT])
        self.module, self.self_check = load_checked(directory, pyfunc_serve_options(config.get(FORMAT_KEY)))
        manifest = read_manifest(directory)
        self.contract = Contract.of(manifest, max_request_batch=sys.maxsize, max_body_bytes=sys.maxsize)

    # model_input carries no type hint: MLflow would infer a schema from one (a dict of arrays has none it accepts);
    # the schema is the tensor signature the model is logged with. MLflow says so once, as a UserWarning.
    def predict(self, context: Any, model_input, params: Optional[Dict[str, Any]] = None) -> Prediction:  # type: ignore[no-untyped-def]
        try:
            decoded = self.contract.checked([np.asarray(a) for a in self._values(model_input)])
        except BadRequest as exc:
            raise MlflowException(exc.message, error_code=INVALID_PARAMETER_VALUE) from None
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in decoded.arrays]
        with torch.no_grad():
            # numpy has no bfloat16: such an output comes back as float32, as the signature states it.
            outputs = [(t.float() if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()
                       for t in flat_tensors(self.module(*tensors))]
        if decoded.single:
            outputs = [o[0] for o in outputs]
        if len(outputs) == 1:
            return outputs[0]
        return dict(zip(self.contract.output_names(len(outputs)), outputs))

    def _values(self, model_input: Any) -> List[Any]:
        """One value per input, in the contract's order (raises BadRequest naming what is accepted)."""
        if isinstance(model_input, dict):
            return self.contract.by_name(model_input)
        names = [spec.name for spec in self.contract.inputs]
        if isinstance(model_input, (np.ndarray, list)) and len(names) == 1:
            return [model_input]
        raise BadRequest(422, f"inputs: expected a dict of arrays keyed by input name {names}"
                              + (" (or the one array)" if len(names) == 1 else "")
                              + f", with the sample axis first; got {type(model_input).__name__}")
