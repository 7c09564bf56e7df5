"""The pyfunc's model code, logged as MLflow's models-from-code file: MLflow runs it to build the model, so nothing
is unpickled (the export's artifacts are loaded by their own checked loaders)."""

import mlflow

from fx_lightning.tracking.pyfunc import FusedExportModel

mlflow.models.set_model(FusedExportModel())
