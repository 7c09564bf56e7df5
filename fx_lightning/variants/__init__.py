"""Lossy serving variants of the verified fused model (int8, bf16), each declared once (:mod:`.base`); the export
side writes them, gates each artifact loaded back and keeps those that pass (:mod:`fx_lightning.export.write.variants`).

Importing this package declares the built-in variants, in the order they are made: int8, then bf16.
"""

from __future__ import annotations

from fx_lightning.variants import base
from fx_lightning.variants.base import *  # noqa: F401,F403 - the declaration's names, listed once in its __all__
from fx_lightning.variants.int8 import INT8, QuantizeInt8Options
from fx_lightning.variants.bf16 import BF16

__all__ = list(base.__all__) + ["INT8", "BF16", "QuantizeInt8Options"]
