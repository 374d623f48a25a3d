"""Every algorithm family runs a few real steps end to end (trainer + rollout processes)."""

from __future__ import annotations

import functools

import pytest
from e2e_helpers import (
    check_the_model_trained_in_the_mode,
    failure_report,
    scalars,
    selected_params,
    submit,
    two_at_a_time,
)

from relax_hpc.config.algo import ALGORITHM_NAMES
from relax_hpc.config.compose import compose_run_config
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.paths import RunPaths, read_json

FAST = [
    "model.warm_start=false",
    "trainer.total_steps=2",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.eval_interval_steps=0",
    "data.eval_size=8",
]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher")
    tiny = compose_run_config(["+experiment=grpo_tiny"]).model  # a random model of that shape
    tokenizer = build_tokenizer(tiny)
    build_causal_lm(tiny, tokenizer, seed=5).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


MODES = [("sync", 0), ("hybrid", 0), ("async", 2)]  # mode, max_staleness
# Each mode's run is also the run of one algorithm (a run costs ~15 s of process starts, an
# algorithm and a mode are independent choices): 11 algorithm runs cover the 3 modes.
ALGORITHM_OF_MODE = {"sync": "dr_grpo", "hybrid": "rloo", "async": "grpo"}
MODE_STEPS = 4


def algorithm_overrides(algo: str, teacher_dir) -> list[str]:
    extra = [f"model.teacher_path={teacher_dir}"] if algo == "opd" else []
    if algo == "ppo":
        extra.append("algo.kl_in_reward_coef=0.01")  # exercises the reference model too
    return [f"algo={algo}", *FAST, *extra]


def mode_overrides(mode: str, staleness: int) -> list[str]:
    return [f"mode={mode}", f"max_staleness={staleness}", f"trainer.total_steps={MODE_STEPS}"]


def case_of(algo: str) -> str:
    """The run that checks ``algo``: ``mode=...`` where it is also a mode's run."""
    modes = [mode for mode, of_mode in ALGORITHM_OF_MODE.items() if of_mode == algo]
    return f"mode={modes[0]}" if modes else f"algo={algo}"


@pytest.fixture(scope="module")
def run_of(request, tmp_path_factory, teacher_dir):
    """``run_of("algo=ppo")`` (or ``"mode=sync"``) -> (run_dir, result): the selected cases'
    runs, two at a time; a mode's run trains its algorithm (``ALGORITHM_OF_MODE``)."""
    modes = selected_params(request, "mode")
    cases = {
        case_of(a): algorithm_overrides(a, teacher_dir) for a in selected_params(request, "algo")
    }
    for mode, staleness in MODES:
        if mode in modes or f"mode={mode}" in cases:
            algorithm = algorithm_overrides(ALGORITHM_OF_MODE[mode], teacher_dir)
            cases[f"mode={mode}"] = [*algorithm, *mode_overrides(mode, staleness)]

    def run(name: str, overrides: list[str]) -> tuple:
        run_dir = tmp_path_factory.mktemp(name.replace("=", "-")) / "run"
        return run_dir, submit(run_dir, *overrides, timeout_s=300)

    with two_at_a_time({n: functools.partial(run, n, o) for n, o in cases.items()}) as runs:
        yield lambda name: runs[name].result()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGORITHM_NAMES)
def test_algorithm_runs_end_to_end(algo, run_of):
    run_dir, result = run_of(case_of(algo))
    assert result.returncode == 0, failure_report(result, run_dir)
    status = read_json(RunPaths(run_dir).trainer_status)
    assert status["step"] == (MODE_STEPS if case_of(algo).startswith("mode=") else 2)
    assert all(v == v for v in status["metrics"].values())  # no NaN reached the logs
    if algo == "ppo":
        assert "loss/critic" in status["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "staleness"), MODES)
def test_each_mode_keeps_its_staleness_bound(mode, staleness, run_of):
    run_dir, result = run_of(f"mode={mode}")
    assert result.returncode == 0, failure_report(result, run_dir)
    paths = RunPaths(run_dir)
    assert f"algo={ALGORITHM_OF_MODE[mode]}" in result.args  # the run of that algorithm too
    series = scalars(paths.trainer_tensorboard_dir)
    assert len(series["staleness/max"]) == MODE_STEPS
    assert max(series["staleness/max"]) <= staleness
    # sync: the engine hands its memory to the trainer after every batch
    released = "time/release_memory_s" in scalars(paths.rollout_tensorboard_dir(0))
    assert released is (mode == "sync")


@pytest.mark.slow
@pytest.mark.parametrize("mode", [mode for mode, _ in MODES])
def test_the_built_in_model_trains_in_the_mode(mode, run_of):
    """The built-in model's column of ``test_model_sources``' matrix, on each mode's run."""
    run_dir, result = run_of(f"mode={mode}")
    check_the_model_trained_in_the_mode(run_dir, result, mode, steps=MODE_STEPS)


@pytest.mark.slow
def test_two_data_parallel_trainer_ranks_train_and_export(tmp_path):
    """FSDP2 over gloo across two trainer processes (the local analogue of 2 tasks/node)."""
    run_dir = tmp_path / "run"
    result = submit(
        run_dir, *FAST, "trainer.processes_per_node=2", "trainer.total_steps=3", timeout_s=300
    )
    assert result.returncode == 0, failure_report(result, run_dir)
    paths = RunPaths(run_dir)
    for rank in (0, 1):
        assert "step 3/3" in paths.task_log("trainer", rank).read_text()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(paths.export_dir)
    assert sum(p.numel() for p in exported.parameters()) > 100_000
