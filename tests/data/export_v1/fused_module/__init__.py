"""Fused model written by fx-lightning: ``from fused_module import FusedModule, load``."""
from .module import FusedModule, load

__all__ = ["FusedModule", "load"]
