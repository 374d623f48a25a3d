"""Your own model folder trains; what cannot start fails once, as a configuration error.

Each run is ``submit`` with ``cluster=local`` (grpo_tiny's shape, two steps): the same
supervisor and components a Slurm job runs. The runs share nothing, and each keeps one core
busy (most stop at submit): the selected cases' runs go two at a time (``result_of``), and
each test asserts on its own run.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
from conftest import cut_short_copy
from e2e_helpers import REPO, failure_report, runs_of_selected_cases, submit

from relax_hpc.paths import RunPaths, read_json

ROLES = ("trainer", "rollout")
TWO_SMALL_STEPS = (
    "model.warm_start=false",
    "trainer.total_steps=2",
    "trainer.checkpoint_interval_steps=2",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "data.eval_size=2",
)


def own_model(folder) -> tuple[str, ...]:
    return (f"model.path={folder}", "model.tokenizer=auto", *TWO_SMALL_STEPS)


def own_model_run(folder, root) -> tuple:
    run_dir = root / "run"
    return run_dir, submit(run_dir, *own_model(folder), timeout_s=300)


def broken_model_run(folder, root) -> tuple:
    """(run_dir, the cut-short copy of ``folder``, the result of its submit)."""
    broken = cut_short_copy(folder, root / "broken-model")
    run_dir = root / "run"
    result = submit(run_dir, *own_model(broken), "cluster.max_restarts=3", timeout_s=300)
    return run_dir, broken, result


def bare_interpreter_run(root) -> tuple:
    """(run_dir, a venv with none of relax_hpc's dependencies, the result of its submit)."""
    venv = root / "bare-venv"  # a real interpreter
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    run_dir = root / "run"
    result = submit(
        run_dir,
        f"cluster.python={venv}/bin/python",
        *TWO_SMALL_STEPS,
        timeout_s=300,
        env={"PYTHONPATH": str(REPO)},  # relax_hpc itself is found; its dependencies are not
    )
    return run_dir, venv, result


def bad_number_run(override: str, root) -> tuple:
    run_dir = root / "run"
    return run_dir, submit(run_dir, override, timeout_s=60)


def bad_file_run(content: bytes, root) -> tuple:
    """(run_dir, a JSONL data file holding ``content``, the result of its submit)."""
    data = root / "train.jsonl"
    data.write_bytes(content)
    run_dir = root / "run"
    file_data = ("data.kind=jsonl", f"data.path={data}", "rollout.eval_interval_steps=0")
    return run_dir, data, submit(run_dir, *file_data, timeout_s=60)


@pytest.fixture(scope="module")
def result_of(request, tmp_path_factory):
    def run_of(test: str, params: dict):
        if test == "test_a_model_folder_written_by_transformers5_trains_two_steps":
            return functools.partial(own_model_run, transformers5(request))
        if test == "test_a_model_folder_that_cannot_load_exits_2_once":
            return functools.partial(broken_model_run, transformers5(request))
        if test == "test_an_interpreter_without_the_dependencies_exits_2_once":
            return bare_interpreter_run
        if test == "test_a_number_out_of_range_exits_2_at_submit":
            return functools.partial(bad_number_run, params["override"])
        assert test == "test_a_data_file_with_a_bad_line_exits_2_naming_file_and_line", test
        return functools.partial(bad_file_run, params["content"])

    with runs_of_selected_cases(request, tmp_path_factory, run_of) as result_of:
        yield result_of


def transformers5(request):
    """The folder of the session's ``transformers5_folder`` (made here, not in a run's thread)."""
    return request.getfixturevalue("transformers5_folder")[0]


@pytest.fixture
def its_case(request, result_of):
    """What this case's run (``result_of``) returned."""
    return result_of(request.node.name)


@pytest.mark.slow
def test_a_model_folder_written_by_transformers5_trains_two_steps(its_case):
    run_dir, result = its_case
    assert result.returncode == 0, failure_report(result, run_dir)
    paths = RunPaths(run_dir)
    assert read_json(paths.trainer_done)["step"] == 2
    assert (paths.checkpoint_dir(2) / "COMPLETE").is_file()
    assert "building it from tokenizer.json" in paths.task_log("trainer", 0).read_text()


@pytest.mark.slow
def test_a_model_folder_that_cannot_load_exits_2_once(its_case):
    run_dir, broken, result = its_case
    assert result.returncode == 2, failure_report(result, run_dir)
    assert f"config error: model.path: {broken} cannot be loaded" in result.stderr
    assert "restart" not in result.stderr  # no "restart 1 of 3", let alone "4 of 3"
    paths = RunPaths(run_dir)
    recorded = read_json(paths.config_error)
    assert recorded["field"] == "model.path"
    # Both roles load the folder; whichever fails first stops the other, maybe before it
    # logged its start. The one that recorded the error started once, and neither again.
    starts = {role: paths.task_log(role, 0).read_text().count("of job attempt") for role in ROLES}
    assert starts[recorded["role"]] == 1, starts
    assert max(starts.values()) == 1, starts


def test_an_interpreter_without_the_dependencies_exits_2_once(its_case):
    run_dir, venv, result = its_case
    assert result.returncode == 2, failure_report(result, run_dir)
    assert f"config error: cluster.python: {venv}/bin/python cannot import" in result.stderr
    assert "leave cluster.python unset" in result.stderr
    assert "restart" not in result.stderr


# Input found wrong only when a role started used to be retried as transient, then failed
# minutes later (issue #34 item 9): each now ends at submit, with exit 2 naming it.
BAD_NUMBERS = [
    pytest.param("rollout.temperature=-1", "rollout.temperature", id="temperature"),
    pytest.param("rollout.top_p=0", "rollout.top_p", id="top-p-zero"),
    pytest.param("rollout.top_p=1.5", "rollout.top_p", id="top-p-above-one"),
    pytest.param("trainer.lr=-1", "trainer.lr", id="lr"),
]


def ends_at_submit_with_exit_2(result: subprocess.CompletedProcess, run_dir, naming: str):
    assert result.returncode == 2, failure_report(result, run_dir)
    assert f"config error: {naming}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not RunPaths(run_dir).logs_dir.exists()  # no role was started


@pytest.mark.parametrize(("override", "field"), BAD_NUMBERS)
def test_a_number_out_of_range_exits_2_at_submit(override, field, its_case):
    run_dir, result = its_case
    ends_at_submit_with_exit_2(result, run_dir, field)


GOOD_ROW = b'{"prompt": "1+1=", "answer": "2"}\n'
BAD_FILES = [
    pytest.param(GOOD_ROW + b'{"prompt": "2+2=", "answer": \n', ":2: not JSON", id="not-json"),
    pytest.param(GOOD_ROW + b'{"prompt": "caf\xe9", "answer": "1"}\n', ":2: not UTF-8", id="latin1"),
    pytest.param(GOOD_ROW + b"\n[1, 2]\n", ":3: a JSON list", id="not-an-object"),
]


@pytest.mark.parametrize(("content", "where"), BAD_FILES)
def test_a_data_file_with_a_bad_line_exits_2_naming_file_and_line(content, where, its_case):
    run_dir, data, result = its_case
    ends_at_submit_with_exit_2(result, run_dir, f"data.path: {data}{where}")
