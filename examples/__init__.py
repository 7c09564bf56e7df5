"""Runnable examples of fx-lightning: a synthetic, learnable dataset and a small CNN (no downloads)."""
