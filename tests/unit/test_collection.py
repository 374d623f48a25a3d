"""The plain test command collects every folder of tests.

pytest skips folders matching ``norecursedirs`` (by default also ``dist``, which once hid
``tests/dist`` from CI). This runs pytest's own collection walk with the project's
configuration, records every Python file it would look at (without importing any), and
compares the test files among them with every ``test_*.py`` under ``tests/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

# A pytest plugin: every .py file the walk reaches is written down and not imported.
RECORDER = """\
import os

def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix == ".py" and collection_path.is_file():
        with open(os.environ["VISITED_LOG"], "a") as log:
            log.write(f"{collection_path}\\n")
        return True
    return None
"""


def modules_on_disk() -> set[Path]:
    return {p.resolve() for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts}


def visited_by_default_collection(tmp_path: Path, *pytest_args: str) -> set[Path]:
    """The .py files pytest's walk reaches with the project's configuration (plus args)."""
    (tmp_path / "visit_recorder.py").write_text(RECORDER)
    log = tmp_path / "visited.log"
    log.touch()
    env = dict(os.environ, VISITED_LOG=str(log))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "--noconftest"]
        + ["-p", "visit_recorder", "-p", "no:cacheprovider", *pytest_args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 5), result.stdout + result.stderr  # 5: nothing collected
    return {Path(line).resolve() for line in log.read_text().splitlines()}


def missed_folders(tmp_path: Path, *pytest_args: str) -> list[str]:
    missed = modules_on_disk() - visited_by_default_collection(tmp_path, *pytest_args)
    return sorted({str(p.parent.relative_to(REPO)) for p in missed})


def test_every_test_folder_is_collected_by_the_plain_command(tmp_path):
    assert len(modules_on_disk()) > 50  # the walk below really looks at the suite
    missed = missed_folders(tmp_path)
    assert missed == [], (
        f"`python -m pytest` does not collect {missed}: rename the folder or fix "
        "norecursedirs in pyproject.toml"
    )


def test_the_guard_sees_a_skipped_folder(tmp_path):
    """pytest's old default (``dist`` in norecursedirs) is caught."""
    assert missed_folders(tmp_path, "-o", "norecursedirs=dist .*") == ["tests/dist"]


def test_test_module_names_are_unique():
    """Test folders have no ``__init__.py``, so pytest imports each test module by its bare
    name: two files of one name in different folders stop the whole collection."""
    names: dict[str, list[str]] = {}
    for path in sorted(modules_on_disk()):
        names.setdefault(path.name, []).append(str(path.parent.relative_to(REPO)))
    clashes = {name: folders for name, folders in names.items() if len(folders) > 1}
    assert clashes == {}, f"rename one of each: {clashes}"
