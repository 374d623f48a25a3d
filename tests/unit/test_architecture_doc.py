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


REPO = DOC.parents[1]
PACKAGE = REPO / "relax_hpc"
PACKAGES_SECTION = re.compile(r"^## Packages and the seams between them$(.*?)^## ", re.M | re.S)
NAMED_PATH = re.compile(r"`([\w/.]+?(?:\.py|/))(?::\w+)?`")
TABLE_ROW = re.compile(r"^\| `([\w/.]+)`")


def named_paths() -> dict[str, Path | None]:
    """Every file or folder the package map names -> where it is (None: nowhere).

    A name is looked up from the repository, from ``relax_hpc/``, and from the package of
    its table row (the rollout row's ``engines/`` is ``relax_hpc/rollout/engines/``)."""
    match = PACKAGES_SECTION.search(DOC.read_text(encoding="utf-8"))
    assert match, "docs/architecture.md lost its package map"
    found: dict[str, Path | None] = {}
    for line in match.group(1).splitlines():
        row = TABLE_ROW.match(line)
        bases = [REPO, PACKAGE] + ([PACKAGE / row[1]] if row and row[1].endswith("/") else [])
        for name in NAMED_PATH.findall(line):
            places = [base / name for base in bases]
            found[name] = next((p.resolve() for p in places if p.exists()), None)
    return found


def test_every_module_the_map_names_exists():
    named = named_paths()
    assert len(named) > 25  # the map really is read
    assert sorted(n for n, where in named.items() if where is None) == [], (
        "docs/architecture.md names these, which do not exist (renamed or moved?)"
    )


def test_every_package_and_top_level_module_is_on_the_map():
    named = {where for where in named_paths().values() if where is not None}
    packages = {init.parent.resolve() for init in PACKAGE.rglob("__init__.py")} - {PACKAGE}
    modules = {m.resolve() for m in PACKAGE.glob("*.py") if m.name != "__init__.py"}
    missing = sorted(str(p.relative_to(PACKAGE)) for p in (packages | modules) - named)
    assert missing == [], "name these in docs/architecture.md's package map"
