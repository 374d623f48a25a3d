"""The sbatch script of an extra rollout pool (``relax_hpc.scale add`` on a Slurm run)."""

from __future__ import annotations

import subprocess

from test_job_plan import plan_for, sbatch_options

from relax_hpc.launch.pool_sbatch import PoolPlacement, load_job_plan, render_pool_sbatch
from relax_hpc.paths import RunPaths, atomic_write_text


def test_a_pool_takes_the_rollout_roles_resources_and_never_requeues(tmp_path):
    paths = RunPaths(tmp_path / "run")
    plan = plan_for("+experiment=grpo_qwen3")
    atomic_write_text(paths.job_plan, plan.to_json())
    script = render_pool_sbatch(load_job_plan(paths), paths, "xab", 2, PoolPlacement())
    options = sbatch_options(script)
    assert "#SBATCH --no-requeue" in options and "#SBATCH --requeue" not in options
    assert "#SBATCH --gpus-per-node=8" in options and "#SBATCH --ntasks=2" in options
    assert f"#SBATCH --output={paths.pool_log('xab')}" in options
    assert "relax_hpc.component rollout --run-dir /runs/test --pool xab" in script
    assert "--output=/runs/test/logs/rollout-xab.%t.log" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_the_operator_moves_a_pool_to_another_partition_and_qos(tmp_path):
    paths = RunPaths(tmp_path / "run")
    atomic_write_text(paths.job_plan, plan_for("+experiment=grpo_tiny").to_json())
    where = PoolPlacement(partition="spare", qos="preemptible", time_min=90)
    options = sbatch_options(render_pool_sbatch(load_job_plan(paths), paths, "xq", 3, where))
    assert {"#SBATCH --partition=spare", "#SBATCH --qos=preemptible"} <= set(options)
    assert "#SBATCH --time=01:30:00" in options and "#SBATCH --nodes=3" in options
