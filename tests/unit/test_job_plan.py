"""Job plan shapes and the rendered sbatch text (golden files in sbatch/)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from relax_hpc.config.compose import compose_run_config
from relax_hpc.config.validate import validate_run_config
from relax_hpc.launch.examples import EXAMPLES_DIR, experiment_names, render_example
from relax_hpc.launch.plan import build_job_plan
from relax_hpc.launch.sbatch import format_time, render_sbatch


def plan_for(*overrides: str):
    cfg = compose_run_config(list(overrides))
    validate_run_config(cfg)
    return build_job_plan(cfg, "/runs/test")


def sbatch_options(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def test_grpo_qwen3_is_a_hetjob_of_two_8_gpu_components():
    plan = plan_for("+experiment=grpo_qwen3")
    assert plan.shape == "hetjob"
    script = render_sbatch(plan)
    options = sbatch_options(script)
    assert options.count("#SBATCH hetjob") == 1
    assert options.count("#SBATCH --gpus-per-node=8") == 2
    leader, member = "\n".join(options).split("#SBATCH hetjob")
    assert "--signal=B:USR1@300" in leader and "--requeue" in leader
    assert "--signal" not in member  # job-wide options belong to component 0 only
    assert "srun --het-group=0" in script and "srun --het-group=1" in script
    assert "relax_hpc.component trainer" in script and "relax_hpc.component rollout" in script


JUDGE_OWN_GPUS = [
    "judge.placement=component",
    "judge.gpus_per_node=4",
    "judge.engine_tensor_parallel=2",
    "cluster.judge_partition=judges",
]


def test_a_judge_of_its_own_is_the_third_component_of_the_hetjob():
    plan = plan_for("+experiment=grpo_qwen3_judge", *JUDGE_OWN_GPUS)
    assert [r.role for r in plan.roles] == ["trainer", "rollout", "judge"]
    judge = plan.role("judge")
    assert (judge.tasks_per_node, judge.gpus_per_node) == (2, 4)  # one server per TP group
    assert plan.total_gpus == 8 + 8 + 4
    script = render_sbatch(plan)
    options = "\n".join(sbatch_options(script))
    assert options.count("#SBATCH hetjob") == 2
    assert options.split("#SBATCH hetjob")[2].count("--partition=judges") == 1
    assert "srun --het-group=2" in script and "relax_hpc.component judge" in script
    assert "component 2 = judge" in script


def test_a_judge_of_its_own_in_a_sync_allocation_gets_devices_of_its_own():
    plan = plan_for("+experiment=grpo_qwen3_colocate", "judge=qwen3_8b", *JUDGE_OWN_GPUS)
    assert plan.shape == "single" and plan.total_gpus == 8 + 4
    script = render_sbatch(plan)
    assert "#SBATCH --gpus-per-node=12" in script and "#SBATCH --ntasks-per-node=10" in script
    steps = [line.strip() for line in script.splitlines() if line.strip().startswith("srun ")]
    assert len(steps) == 3 and "--exact" in steps[2] and "component judge" in steps[2]


def test_a_judge_on_the_rollouts_engines_adds_no_component():
    plan = plan_for("+experiment=grpo_qwen3_judge")
    assert [r.role for r in plan.roles] == ["trainer", "rollout"]


def test_colocated_sync_is_one_allocation_with_overlapping_steps():
    plan = plan_for("+experiment=grpo_qwen3_colocate")
    assert plan.shape == "single" and plan.total_gpus == 8
    script = render_sbatch(plan)
    assert "hetjob" not in "\n".join(sbatch_options(script))
    assert "#SBATCH --nodes=1" in script and "#SBATCH --gpus-per-node=8" in script
    steps = [line.strip() for line in script.splitlines() if line.strip().startswith("srun ")]
    assert len(steps) == 2 and all("--overlap" in step for step in steps)
    # 8 trainer tasks x 8 CPUs cover the rollout's 32: the allocation is the larger demand.
    assert "#SBATCH --ntasks-per-node=8" in script and "#SBATCH --cpus-per-task=8" in script


def test_shared_nodes_split_the_gpus_between_exclusive_steps():
    plan = plan_for(
        "+experiment=grpo_qwen3",
        "cluster.share_nodes=true",
        "trainer.gpus_per_node=4",
        "trainer.parallel.tensor=2",
        "rollout.gpus_per_node=4",
    )
    script = render_sbatch(plan)
    assert plan.shape == "single"
    assert "#SBATCH --gpus-per-node=8" in script
    steps = [line.strip() for line in script.splitlines() if line.strip().startswith("srun ")]
    assert all("--exact" in s and "--gpus-per-node=4" in s for s in steps)


def test_cpu_tiny_run_is_a_hetjob_without_gpus():
    plan = plan_for("+experiment=grpo_tiny")
    assert plan.shape == "hetjob" and plan.total_gpus == 0
    assert "gpus" not in render_sbatch(plan)


def test_partitions_account_qos_and_extra_options_are_rendered():
    script = render_sbatch(
        plan_for(
            "+experiment=grpo_qwen3",
            "cluster.trainer_partition=train",
            "cluster.rollout_partition=gen",
            "cluster.account=proj",
            "cluster.qos=high",
            "+cluster.extra_sbatch.constraint=h100",
            "cluster.setup=[module load cuda]",
        )
    )
    leader, member = script.split("#SBATCH hetjob")
    assert "--partition=train" in leader and "--partition=gen" in member
    assert script.count("#SBATCH --account=proj") == 2 and script.count("#SBATCH --qos=high") == 2
    assert script.count("#SBATCH --constraint=h100") == 2
    assert "\nmodule load cuda\n" in script


@pytest.mark.parametrize(
    ("minutes", "text"), [(5, "00:05:00"), (90, "01:30:00"), (1500, "1-01:00:00")]
)
def test_time_format(minutes, text):
    assert format_time(minutes) == text


@pytest.mark.parametrize("name", experiment_names())
def test_sbatch_examples_match_the_renderer(name):
    """sbatch/ is the golden copy; regenerate with python -m relax_hpc.launch.examples."""
    golden = EXAMPLES_DIR / f"{name}.sbatch"
    assert golden.is_file(), f"missing {golden}; run python -m relax_hpc.launch.examples"
    assert golden.read_text() == render_example(name)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("name", experiment_names())
def test_rendered_scripts_are_valid_bash(name, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_example(name))
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_the_vision_recipe_dry_run_renders_its_gpu_job(tmp_path, capsys):
    """grpo_qwen3_vl: the torch/FSDP2 trainer (Megatron has no Qwen3-VL mapping) and SGLang
    engines on 8 GPUs of one node, time-shared in sync mode; nothing is created."""
    from relax_hpc import submit

    run_dir = tmp_path / "run"
    argv = ["+experiment=grpo_qwen3_vl", "cluster=slurm", f"run_dir={run_dir}", "dry_run=true"]
    assert submit.run(argv) == 0
    out = capsys.readouterr().out
    assert "# --- trainer: torch, 1 node(s) x 8 GPU(s), 8 task(s) per node" in out
    assert "# --- rollout: sglang, 1 node(s) x 8 GPU(s), 8 task(s) per node" in out
    assert "#SBATCH --gpus-per-node=8" in out and "sync mode: both steps time-share" in out
    assert f"relax_hpc.component trainer --run-dir {run_dir}" in out
    assert f"relax_hpc.component rollout --run-dir {run_dir}" in out
    assert not run_dir.exists()
