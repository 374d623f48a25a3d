"""Typed configuration of a run: schemas, validation, and the resolved-config file.

``import relax_hpc.config`` does not import Hydra; composition from ``configs/`` lives in
``relax_hpc.config.compose`` and is used only by the ``submit`` entry point.
"""

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.resolved import load_run_config, run_config_to_yaml, write_resolved_config
from relax_hpc.config.schema import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    ObserveConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from relax_hpc.config.validate import (
    check_paths_exist,
    data_parallel_size,
    trainer_world_size,
    validate_run_config,
)

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "ObserveConfig",
    "ParallelConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
    "check_paths_exist",
    "data_parallel_size",
    "load_run_config",
    "run_config_to_yaml",
    "trainer_world_size",
    "validate_run_config",
    "write_resolved_config",
]
