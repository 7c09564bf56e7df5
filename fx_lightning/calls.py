"""``fx_lightning.calls``, where the module was before issue 40's layout
(docs/callback.md named ``fx_lightning.calls.Call`` for example inputs):
it is :mod:`fx_lightning.common.calls`, whose public names this re-exports."""

from fx_lightning.common.calls import *  # noqa: F401,F403 - its __all__
from fx_lightning.common.calls import __all__  # noqa: F401
