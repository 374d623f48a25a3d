"""The built-in tasks by name, and which one a run's policy warm-starts on.

``TASKS`` is a ``plugins.Registry`` like every plug-in kind's: a name -> the ``Task`` object
of its module (``package.module:TASK``), imported only when asked for. ``data.kind`` names the
task whose prompts a run trains on (``data_task``). A config names a
task where a model is warm-started: ``judge.warm_start`` and
``rewards.reward_models.<name>.warm_start`` name one directly; a policy's
(``model.warm_start: true``) follows from its modality, the run's environment and its data
(``policy_task``).

Must not: import a task's module before it is asked for (they load torch and transformers).
"""

from __future__ import annotations

from pathlib import Path

from relax_hpc.config.schema import DataConfig, ModelConfig
from relax_hpc.plugins import Plugin, Registry
from relax_hpc.tasks.base import Task

TASKS = Registry(
    "warm_start",
    "task",
    {
        "addition": Plugin("relax_hpc.tasks.addition:TASK"),
        "addition_verifier": Plugin("relax_hpc.tasks.verifier:TASK"),
        "addition_scorer": Plugin("relax_hpc.tasks.scorer:TASK"),
        "calculator": Plugin("relax_hpc.tasks.calculator:TASK"),
        "guess_number": Plugin("relax_hpc.tasks.guess:TASK"),
        "shapes": Plugin("relax_hpc.tasks.media:SHAPES"),
        "pitch": Plugin("relax_hpc.tasks.media:PITCH"),
    },
    what="object",
)
# rollout.environment -> the task whose episodes it runs (checked before data.kind: the
# calculator's prompts are synthetic additions, its warm start is not addition's).
ENVIRONMENT_TASKS = {"calculator": "calculator"}
# data.kind -> the task that poses its prompts; any other kind gets addition's warm start,
# which refuses it with a message naming data.kind.
DATA_TASKS = {"synthetic_addition": "addition", "guess_number": "guess_number"}
DEFAULT_POLICY_TASK = "addition"
# A media policy (model.modality not text) warm-starts on data.media_task, else this one.
DEFAULT_MEDIA_TASK = "shapes"


def task(name: str, field: str = "warm_start") -> Task:
    """The task ``name`` (a built-in, or ``package.module:TASK``); ``field`` is the config
    field that named it, for the error when it names none."""
    found = Registry(field, TASKS.kind, TASKS.plugins, TASKS.what).load(name)
    if not isinstance(found, Task):
        raise ValueError(f"{field}: {name} is a {type(found).__name__}, not a tasks.base.Task")
    return found


def policy_task_name(model_cfg: ModelConfig, data_cfg: DataConfig, environment: str | None) -> str:
    """The task a run's policy warm-starts on: a media policy's media task; else its
    environment's, else its data's."""
    if model_cfg.modality != "text":
        return data_cfg.media_task or DEFAULT_MEDIA_TASK
    if environment in ENVIRONMENT_TASKS:
        return ENVIRONMENT_TASKS[environment]
    return DATA_TASKS.get(data_cfg.kind, DEFAULT_POLICY_TASK)


def data_task(data_cfg: DataConfig) -> Task | None:
    """The task whose prompts ``data.kind`` names (``media_task``: ``data.media_task``), or
    None for the kinds read from files (jsonl, parquet)."""
    if data_cfg.kind == "media_task":
        return task(data_cfg.media_task, "data.media_task")
    if data_cfg.kind in DATA_TASKS:
        return task(DATA_TASKS[data_cfg.kind], "data.kind")
    return None


def policy_task(model_cfg: ModelConfig, data_cfg: DataConfig, environment: str | None) -> Task:
    """The ``Task`` of a run's policy (``model.warm_start: true``); trainer and rollout ask
    here, so both warm-start (and cache) the same model."""
    return task(policy_task_name(model_cfg, data_cfg, environment), "model.warm_start")


def policy_warm_start(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    environment: str | None,
    cache_dir: Path | None = None,
) -> Path:
    """The warm-started folder of a run's policy (trained the first time) under
    ``cache_dir`` (default ``$RELAX_HPC_CACHE_DIR``)."""
    from relax_hpc.paths import default_cache_dir

    chosen = policy_task(model_cfg, data_cfg, environment)
    return chosen.warm_start(model_cfg, data_cfg, cache_dir or default_cache_dir())
