"""Render the shipped experiments into ``sbatch/`` for people who read or submit by hand.

``python -m relax_hpc.launch.examples`` rewrites the files; a unit test fails when they
drift from what the renderer produces (they are the golden files of the renderer).
The run directory in these scripts is ``runs/<experiment>``, relative to the directory
``sbatch`` is called from.
"""

from __future__ import annotations

import sys
from pathlib import Path

from relax_hpc.config.compose import compose_run_config, default_config_dir
from relax_hpc.config.validate import validate_run_config
from relax_hpc.launch.plan import build_job_plan
from relax_hpc.launch.sbatch import render_sbatch

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "sbatch"
EXAMPLE_HEADER = """\
# Example rendered by `python -m relax_hpc.launch.examples` for +experiment={name}
# cluster=slurm. To submit it by hand from the repository root, create the run directory
# and its config first, then submit this file (or the job.sbatch written beside it):
#   python -m relax_hpc.submit +experiment={name} cluster=slurm run_dir=runs/{name} prepare_only=true
#   sbatch sbatch/{name}.sbatch
# `python` below stands for cluster.python, which submit sets to the interpreter it ran with.
"""


def experiment_names(config_dir: Path | None = None) -> list[str]:
    folder = (config_dir or default_config_dir()) / "experiment"
    return sorted(path.stem for path in folder.glob("*.yaml"))


def render_example(name: str) -> str:
    # A fixed interpreter name: the files must not depend on the machine that renders them.
    cfg = compose_run_config([f"+experiment={name}", "cluster=slurm", "cluster.python=python"])
    validate_run_config(cfg, check_paths=False)
    script = render_sbatch(build_job_plan(cfg, f"runs/{name}"))
    shebang, rest = script.split("\n", 1)
    return f"{shebang}\n{EXAMPLE_HEADER.format(name=name)}{rest}"


def write_examples(folder: Path = EXAMPLES_DIR) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in experiment_names():
        path = folder / f"{name}.sbatch"
        path.write_text(render_example(name), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_examples():
        print(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path)
    sys.exit(0)
