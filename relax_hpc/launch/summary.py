"""The closing summary a user reads after a local run: what was learned, where things are."""

from __future__ import annotations

import sys

from relax_hpc.paths import RunPaths, read_json


def _read(path):
    try:
        return read_json(path)
    except (FileNotFoundError, ValueError):
        return None


def summary_lines(paths: RunPaths, exit_code: int) -> list[str]:
    lines = []
    done = _read(paths.status_dir / "trainer_done.json")
    trainer = _read(paths.status_dir / "trainer.json")
    evals = (_read(paths.status_dir / "eval.json") or {}).get("history", [])
    if done:
        lines.append(f"finished {done['step']} steps ({done['samples']} samples)")
    elif trainer:
        state = (
            "stopped with a checkpoint" if exit_code == 75 else f"ended with exit code {exit_code}"
        )
        lines.append(f"{state} at step {trainer['step']}; resume with run_dir={paths.root}")
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"held-out greedy accuracy {first['accuracy']:.1%} (policy v{first['policy_version']}) "
            f"-> {last['accuracy']:.1%} (v{last['policy_version']})"
        )
    lines.append(f"TensorBoard: tensorboard --logdir {paths.tensorboard_dir}")
    if done:
        lines.append(f"exported Hugging Face model: {done['export_dir']}")
    lines.append(f"logs: {paths.logs_dir}")
    return lines


def print_summary(paths: RunPaths, exit_code: int) -> None:
    for line in summary_lines(paths, exit_code):
        print(f"relax_hpc: {line}", file=sys.stderr)
