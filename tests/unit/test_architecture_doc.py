"""docs/architecture.md lists every path of ``RunPaths``, and only those, correctly."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from relax_hpc.paths import RunPaths

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
ROOT = Path("/run")
ROW = re.compile(r"^\| `([^`]+)` \| `(\w+)` \|")


def documented() -> dict[str, str]:
    """RunPaths member -> the path pattern of its row in the doc's table."""
    rows = [ROW.match(line) for line in DOC.read_text(encoding="utf-8").splitlines()]
    return {match[2]: match[1] for match in rows if match}


def exposed_paths() -> dict[str, Path]:
    """Every path ``RunPaths`` computes; methods get 7 for each argument."""
    paths = RunPaths(ROOT)
    found = {}
    for name, member in inspect.getmembers(RunPaths):
        if name.startswith("_") or name in ("root", "create"):
            continue
        if isinstance(member, property):
            found[name] = getattr(paths, name)
        elif inspect.isfunction(member):
            arguments = list(inspect.signature(member).parameters)[1:]
            found[name] = getattr(paths, name)(*[7] * len(arguments))
    return found


def test_every_run_directory_path_is_on_the_map_and_nothing_else():
    exposed, rows = exposed_paths(), documented()
    assert len(exposed) > 30  # the introspection really finds them
    assert sorted(set(exposed) - set(rows)) == [], "add these RunPaths to docs/architecture.md"
    assert sorted(set(rows) - set(exposed)) == [], "these rows name no RunPaths member"


def test_each_row_spells_its_path():
    for name, path in exposed_paths().items():
        pattern = documented()[name].rstrip("/")
        regex = re.sub(r"<\w+>", ".+", re.escape(pattern).replace(r"\<", "<").replace(r"\>", ">"))
        relative = str(path.relative_to(ROOT))
        assert re.fullmatch(regex, relative), f"{name}: the doc says {pattern}, it is {relative}"
