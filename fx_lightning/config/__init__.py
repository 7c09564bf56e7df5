"""fx-lightning's configuration: the public names, from the modules that each do one job.

- :mod:`~fx_lightning.config.schema`: the enums and the dataclasses (:class:`FuseConfig` and its sections),
  each dataclass checking its own values (``check()``);
- :mod:`~fx_lightning.config.loading`: :func:`load_config` (every source merged into the schema, every
  failure a :class:`ConfigError` naming the full key), :func:`to_yaml`, :func:`to_container`;
- :mod:`~fx_lightning.config.hydra`: :func:`register_hydra_configs`.
"""

from __future__ import annotations

from fx_lightning.config import schema
from fx_lightning.config.hydra import register_hydra_configs
from fx_lightning.config.loading import ConfigLike, load_config, to_container, to_yaml, validate
from fx_lightning.config.schema import *  # noqa: F401,F403 - the schema's names, listed once in its __all__
from fx_lightning.errors import ConfigError

__all__ = [*schema.__all__, "ConfigError", "ConfigLike", "load_config", "validate", "to_yaml", "to_container",
           "register_hydra_configs"]
