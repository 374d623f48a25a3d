"""The dependency rules of docs/architecture.md (its "Rules" paragraph), on the source tree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "relax_hpc"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules_under(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py")) if folder else sorted(PACKAGE.rglob("*.py"))


def importers_of(prefix: str) -> list[str]:
    found = []
    for path in modules_under(""):
        if any(name == prefix or name.startswith(prefix + ".") for name in imported_modules(path)):
            found.append(str(path.relative_to(PACKAGE.parent)))
    return found


def test_trainer_and_rollout_never_import_each_other():
    for path in modules_under("trainer"):
        assert not any(n.startswith("relax_hpc.rollout") for n in imported_modules(path)), path
    for path in modules_under("rollout"):
        assert not any(n.startswith("relax_hpc.trainer") for n in imported_modules(path)), path


def test_tasks_never_import_the_roles_process_code():
    """A task owns its data, reward and warm start; the roles ask it, never the reverse."""
    for path in modules_under("tasks"):
        roles = {
            n
            for n in imported_modules(path)
            if _within(n, "relax_hpc.trainer") or _within(n, "relax_hpc.rollout")
        }
        assert not roles, f"{path} imports {roles}"


def test_models_never_import_the_tasks_and_data_only_their_registry():
    """Tasks are built on models and data's generators; a model builder that reached back
    into a task (as the media policy's did) would hide which task a run warm-starts on. The
    dataset asks the registry for the task ``data.kind`` names, nothing more."""
    for path in modules_under("models"):
        named = {n for n in imported_modules(path) if _within(n, "relax_hpc.tasks")}
        assert not named, f"{path} imports {named}"
    for path in modules_under("data"):
        named = {n for n in imported_modules(path) if _within(n, "relax_hpc.tasks")}
        assert named <= {"relax_hpc.tasks.registry"}, f"{path} imports {named}"


def test_the_roles_reach_a_task_only_through_its_registry():
    """Trainer and rollout ask ``tasks.registry`` for the task of their config (and use the
    shared ``tasks.warm_start``); none names a task's own module."""
    allowed = ("relax_hpc.tasks.registry", "relax_hpc.tasks.warm_start", "relax_hpc.tasks.base")
    for path in modules_under("trainer") + modules_under("rollout"):
        named = {n for n in imported_modules(path) if _within(n, "relax_hpc.tasks")}
        assert named <= set(allowed), f"{path} imports {named - set(allowed)}"


@pytest.mark.parametrize(
    ("library", "allowed"),
    [
        ("hydra", ("relax_hpc/submit.py", "relax_hpc/config/")),
        ("omegaconf", ("relax_hpc/submit.py", "relax_hpc/config/")),
        ("megatron", ("relax_hpc/trainer/megatron/",)),
        ("sglang", ("relax_hpc/rollout/",)),
    ],
)
def test_heavy_libraries_stay_in_their_corner(library, allowed):
    outside = [p for p in importers_of(library) if not p.startswith(allowed)]
    assert outside == [], f"{library} imported outside {allowed}: {outside}"


def test_only_entry_points_import_launch_and_submit():
    for target in ("relax_hpc.launch", "relax_hpc.submit"):
        users = [
            p
            for p in importers_of(target)
            if not p.startswith(
                (
                    "relax_hpc/launch/",
                    "relax_hpc/submit.py",
                    "relax_hpc/status.py",
                    "relax_hpc/cancel.py",
                    "relax_hpc/scale.py",
                    "relax_hpc/component.py",  # a rollout task runs under its keeper
                )
            )
        ]
        assert users == [], f"{target} imported by {users}"


# Leaves, and the only modules of ours each may import besides its own.
LEAVES = {
    "paths.py": (),
    "exitcodes.py": (),
    "plugins.py": (),  # the module:name resolver every registry shares
    "config": ("relax_hpc.paths",),
    "algo": ("relax_hpc.config.algo",),  # its own config dataclass
}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaves_import_nothing_of_ours(leaf):
    files = [PACKAGE / leaf] if leaf.endswith(".py") else modules_under(leaf)
    own = f"relax_hpc.{leaf.removesuffix('.py')}"
    for path in files:
        ours = {n for n in imported_modules(path) if _within(n, "relax_hpc")}
        foreign = {n for n in ours if not any(_within(n, p) for p in (own, *LEAVES[leaf]))}
        assert not foreign, f"{path} imports {foreign}"


def test_importing_the_config_loads_no_torch_and_nothing_else_of_ours():
    """What a login node pays for ``import relax_hpc.config`` (checked in a fresh process)."""
    probe = (
        "import sys, relax_hpc.config; "
        "print(' '.join(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'h5py', 'relax_hpc'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    assert not [m for m in loaded if not m.startswith("relax_hpc")], loaded
    ours = [m for m in loaded if m != "relax_hpc"]
    assert all(_within(m, "relax_hpc.config") or m == "relax_hpc.paths" for m in ours), ours
