"""Serving a verified export: an HTTP server on LitServe (``fx-lightning serve``) and a Triton Inference Server
model repository (``fx-lightning triton``), both driven by the export's input contract in ``manifest.json``."""
