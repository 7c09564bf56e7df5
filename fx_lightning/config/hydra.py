"""Hydra: the schema registered in Hydra's ConfigStore. Hydra is imported only when this is called, so
fx-lightning does not need it installed."""

from __future__ import annotations

from omegaconf import OmegaConf

from fx_lightning.config.schema import FuseConfig

__all__ = ["register_hydra_configs"]


def register_hydra_configs(group: str = "callbacks", name: str = "fx_fuse") -> None:
    """Register the schema in Hydra's ConfigStore.

    Stores ``fx_fuse_schema`` (the bare FuseConfig, for ``defaults:`` schema matching) and
    ``<group>/<name>``: ``{<name>: {_target_: fx_lightning.FXFuseCallback, <default options>}}``. The node
    sits under its own name, like configs/callbacks/fx_fuse.yaml and every entry of a Lightning
    ``callbacks`` group (``cfg.callbacks.<name>._target_``), so Hydra's schema matching of that YAML onto
    this node type-checks it instead of failing with "Key 'fx_fuse' not in 'FuseConfig'".
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="fx_fuse_schema", node=FuseConfig)
    node = OmegaConf.merge({"_target_": "fx_lightning.FXFuseCallback"}, OmegaConf.structured(FuseConfig))
    cs.store(group=group, name=name, node={name: node})
