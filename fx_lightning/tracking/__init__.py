"""Where the verified export goes after it is written, on top of the pipeline like the servers: an MLflow run and
model registry (:mod:`.mlflow_export`), as a pyfunc model over the export's checked loader (:mod:`.pyfunc`).

MLflow is an optional dependency (``pip install 'fx-lightning[mlflow]'``): nothing here imports it until it is used.
"""

from fx_lightning.tracking.mlflow_export import (
    EXPORT_ARTIFACT,
    LoggedExport,
    MlflowRun,
    RegisteredVersion,
    check_destination,
    export_tags,
    log_export,
    model_signature,
    pip_requirements,
    pyfunc_serve_options,
)

__all__ = ["EXPORT_ARTIFACT", "LoggedExport", "MlflowRun", "RegisteredVersion", "check_destination", "export_tags",
           "log_export", "model_signature", "pip_requirements",
           "pyfunc_serve_options"]
