"""Hydra composition: ``configs/`` + command-line overrides -> a typed ``RunConfig``.

The only module that imports Hydra. Every group's dataclass schema is registered in
Hydra's ConfigStore, so a misspelt key or a wrong type fails at composition; Hydra's own
exceptions are turned into ``ConfigError`` naming the key.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import RunConfig

SCHEMA_NAME = "run_schema"
CONFIG_DIR_ENV = "RELAX_HPC_CONFIG_DIR"


def default_config_dir() -> Path:
    """``configs/`` beside the package (editable install), or ``$RELAX_HPC_CONFIG_DIR``."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override).resolve()
    return Path(__file__).resolve().parents[2] / "configs"


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)


def compose_run_config(overrides: list[str], config_dir: Path | None = None) -> RunConfig:
    """Compose ``config.yaml`` with ``overrides`` (Hydra syntax) into a ``RunConfig``."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    config_dir = config_dir or default_config_dir()
    if not (config_dir / "config.yaml").is_file():
        raise ConfigError(
            CONFIG_DIR_ENV,
            f"no config.yaml in {config_dir}; install relax_hpc editable (pip install -e .) "
            f"or point {CONFIG_DIR_ENV} at the configs/ folder",
        )
    register_schemas()
    try:
        with initialize_config_dir(str(config_dir), version_base="1.3", job_name="relax_hpc"):
            composed = compose(config_name="config", overrides=list(overrides))
        _reject_missing(composed)
        cfg = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as err:
        raise _as_config_error(err) from None
    assert isinstance(cfg, RunConfig)
    return cfg


def _reject_missing(composed) -> None:
    missing = sorted(OmegaConf.missing_keys(composed))
    if missing:
        raise ConfigError(
            missing[0],
            "is required and has no value; set it in the experiment or on the command line",
        )


def _as_config_error(err: Exception) -> ConfigError:
    """Name the offending key of a Hydra/OmegaConf error in one line."""
    inner = err
    while inner.__cause__ is not None and not isinstance(inner, OmegaConfBaseException):
        inner = inner.__cause__
    key = getattr(inner, "full_key", None)
    text = getattr(inner, "msg", None) or str(inner)
    first_line = text.strip().splitlines()[0] if text.strip() else type(inner).__name__
    if "not in" in first_line and key:
        return ConfigError(key, f"unknown key ({first_line}); check its spelling and group")
    if key:
        return ConfigError(key, first_line)
    return ConfigError("overrides", first_line)
