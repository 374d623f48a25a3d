"""``relayout=true``: only the trainer's resources and the job's placement move."""

from __future__ import annotations

from dataclasses import replace

from relax_hpc import exitcodes, submit
from relax_hpc.config import load_run_config
from relax_hpc.config.relayout import relayout
from relax_hpc.config.schema import ClusterConfig, ParallelConfig, RunConfig, TrainerConfig
from relax_hpc.paths import RunPaths, read_json


def test_relayout_moves_trainer_resources_and_placement_only():
    stored = RunConfig(name="run", trainer=TrainerConfig(nodes=4, gpus_per_node=8, lr=1e-6))
    requested = replace(
        stored,
        seed=7,
        trainer=TrainerConfig(nodes=2, gpus_per_node=8, lr=0.5, parallel=ParallelConfig(tensor=2)),
        cluster=ClusterConfig(partition="short", max_restarts=9),
    )
    moved, changes = relayout(stored, requested)
    assert (moved.trainer.nodes, moved.trainer.parallel.tensor) == (2, 2)
    assert moved.cluster.partition == "short"
    assert (moved.trainer.lr, moved.seed, moved.cluster.max_restarts) == (1e-6, 1, 3)
    assert "trainer.nodes: 4 -> 2" in changes and "cluster.partition: None -> short" in changes
    assert not any(c.startswith(("trainer.lr", "seed", "cluster.max_restarts")) for c in changes)


def test_submit_relayout_rewrites_the_stored_config(tmp_path, capsys):
    run_dir = tmp_path / "run"
    base = ["+experiment=grpo_tiny", f"run_dir={run_dir}", "prepare_only=true"]
    assert submit.run(base) == 0
    argv = [*base, "relayout=true", "trainer.processes_per_node=2", "trainer.lr=0.5"]
    assert submit.run(argv) == 0
    err = capsys.readouterr().err
    assert "relayout: trainer.processes_per_node: 1 -> 2" in err and "are ignored" in err
    paths = RunPaths(run_dir)
    stored = load_run_config(paths.resolved_config)
    assert stored.trainer.processes_per_node == 2
    assert stored.trainer.lr != 0.5
    trainer_plan = read_json(paths.job_plan)["roles"][0]
    assert trainer_plan["role"] == "trainer" and trainer_plan["tasks_per_node"] == 2
    # Without relayout the stored layout wins again.
    assert submit.run([*base, "trainer.processes_per_node=1"]) == 0
    assert load_run_config(paths.resolved_config).trainer.processes_per_node == 2


def test_relayout_of_a_new_run_directory_is_a_config_error(tmp_path, capsys):
    argv = ["+experiment=grpo_tiny", f"run_dir={tmp_path / 'new'}", "relayout=true"]
    assert submit.run(argv) == exitcodes.CONFIG_ERROR
    assert "relayout: " in capsys.readouterr().err and not (tmp_path / "new").exists()
