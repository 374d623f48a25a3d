"""The task registry: every built-in task is found by its name, its tables agree with the
tasks they name, a user's ``package.module:TASK`` loads, and a wrong name is refused."""

from __future__ import annotations

import pytest

from relax_hpc.config.rewards import RM_WARM_STARTS
from relax_hpc.config.schema import JUDGE_WARM_STARTS, MEDIA_TASKS, DataConfig, ModelConfig
from relax_hpc.plugins import PluginError
from relax_hpc.tasks.base import Task
from relax_hpc.tasks.registry import (
    DATA_TASKS,
    ENVIRONMENT_TASKS,
    TASKS,
    data_task,
    policy_task,
    task,
)

# A user's task: this module's own object, as a config would name it.
MY_TASK = Task(name="mine", data_kind="jsonl", warm_start=lambda model, data, cache: cache)


@pytest.mark.parametrize("name", TASKS.names())
def test_every_built_in_task_loads_under_its_own_name(name):
    found = task(name)
    assert isinstance(found, Task) and found.name == name and callable(found.warm_start)


def test_the_tables_name_tasks_that_agree():
    for environment, name in ENVIRONMENT_TASKS.items():
        assert task(name).environment == environment
    for kind, name in DATA_TASKS.items():
        assert task(name).data_kind == kind and task(name).warm_starts == "policy"
    assert task("calculator").data_kind == "synthetic_addition"
    judges = [n for n in JUDGE_WARM_STARTS if n != "none"]
    scorers = [n for n in RM_WARM_STARTS if n != "none"]
    assert [task(n).warm_starts for n in judges] == ["judge"] * len(judges)
    assert [task(n).warm_starts for n in scorers] == ["reward_model"] * len(scorers)


TEXT = ModelConfig(name="t")
VL = ModelConfig(name="v", architecture="Qwen3VLForConditionalGeneration", modality="vision")


def test_a_policy_gets_the_task_of_its_environment_else_of_its_data():
    addition = DataConfig(kind="synthetic_addition")
    assert policy_task(TEXT, addition, "calculator").name == "calculator"
    assert policy_task(TEXT, addition, "my_lab.envs:Agent").name == "addition"
    guess = DataConfig(kind="guess_number")
    assert policy_task(TEXT, guess, "guess_number").name == "guess_number"
    # Any other kind: addition's warm start, which refuses the kind with the field's name.
    assert policy_task(TEXT, DataConfig(kind="jsonl"), None).name == "addition"
    assert policy_task(TEXT, DataConfig(kind="media_task"), None).name == "addition"


def test_a_media_policy_gets_its_media_task_whatever_its_data():
    for name in MEDIA_TASKS:
        media = DataConfig(kind="media_task", media_task=name)
        assert policy_task(VL, media, None).name == name
        assert task(name).data_kind == "media_task"
    assert policy_task(VL, DataConfig(kind="jsonl"), None).name == "shapes"  # the default


def test_data_kind_names_the_task_that_poses_its_rows():
    assert data_task(DataConfig(kind="synthetic_addition")).name == "addition"
    assert data_task(DataConfig(kind="guess_number")).name == "guess_number"
    assert data_task(DataConfig(kind="media_task", media_task="pitch")).name == "pitch"
    assert data_task(DataConfig(kind="jsonl", path="rows.jsonl")) is None
    posing = {name for name in TASKS.names() if task(name).rows is not None}
    assert posing == {"addition", "guess_number", *MEDIA_TASKS}  # the others pose addition's
    rows = task("addition").rows(DataConfig(digits=1, eval_size=10), "eval", 0)
    assert len(rows) == 10 and rows[0]["prompt"].endswith("=")


def test_a_users_task_loads_and_a_wrong_name_is_refused():
    assert task(f"{__name__}:MY_TASK", "judge.warm_start") is MY_TASK
    with pytest.raises(PluginError, match=r"^judge.warm_start: 'nope' is not a built-in task"):
        task("nope", "judge.warm_start")
    with pytest.raises(ValueError, match=r"judge.warm_start: .*:TASKS is a Registry, not a"):
        task("relax_hpc.tasks.registry:TASKS", "judge.warm_start")
