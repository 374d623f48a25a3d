"""Write and read the resolved config of a run (``RunPaths.resolved_config``).

Jobs, requeued jobs and resumed jobs read only this file: they never re-compose from a
working tree that may have changed since submission. OmegaConf is used here as a typed
YAML reader; callers get plain dataclasses back.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import RunConfig
from relax_hpc.paths import atomic_write_text

log = logging.getLogger(__name__)

# Keys that earlier versions wrote and that no longer exist. A run submitted before an
# upgrade, then requeued after it, must still load: these are dropped with a warning.
# Any other unknown key is still an error. The submit options (dry_run, ...) were fields
# of RunConfig once; relax_hpc.submit takes them off the command line now.
REMOVED_KEYS = (
    "dry_run",
    "prepare_only",
    "relayout",
    "observe.tensorboard",
    "observe.progress_bar",
    "observe.log_interval_steps",
)


# (key, value an earlier version wrote, what it means now). Early versions wrote
# rollout.environment: single_turn (and max_turns: 1) as placeholders of a one-turn run.
LEGACY_VALUES = (("rollout.environment", "single_turn", None),)


def run_config_to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def write_resolved_config(cfg: RunConfig, path: Path) -> Path:
    header = "# Resolved by relax_hpc.submit; jobs and resumed jobs read only this file.\n"
    return atomic_write_text(path, header + run_config_to_yaml(cfg))


def load_run_config(path: Path | str) -> RunConfig:
    """Read a resolved config into ``RunConfig``; unknown or mistyped keys are errors."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "no resolved config here; is this a relax_hpc run directory?")
    try:
        stored = _without_removed_keys(OmegaConf.load(path), path)
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), stored)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or str(path)
        raise ConfigError(key, f"{err.msg if hasattr(err, 'msg') else err} (in {path})") from None
    assert isinstance(cfg, RunConfig)
    return cfg


def _without_removed_keys(stored, path: Path):
    for dotted, legacy, now in LEGACY_VALUES:
        if OmegaConf.select(stored, dotted) == legacy:
            log.warning("config: %s: %s (in %s) is read as %s", dotted, legacy, path, now)
            OmegaConf.update(stored, dotted, now)
    for dotted in REMOVED_KEYS:
        section, _, key = dotted.rpartition(".")
        node = OmegaConf.select(stored, section) if section else stored
        if node is not None and key in node:
            log.warning("config: %s (in %s) is no longer used; ignored", dotted, path)
            del node[key]
    return stored
