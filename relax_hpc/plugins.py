"""Plug-ins: the one ``package.module:name`` resolver, and the registry every plug-in kind keeps.

A plug-in kind (trainer backends, rollout engines, environments, ...) keeps one
``Registry``: built-in names -> ``Plugin`` (the object that builds one, as
``package.module:name``, the libraries it needs where the job runs and the pip extra that
installs them). A config field names a built-in or, for one of the user's own,
``package.module:name`` importable where the job runs. ``docs/architecture.md`` lists the
registries and the recipe for each kind.

Must not: import anything of ours or any heavy library (``Registry.missing_libraries`` asks
importlib whether a library is installed without importing it; a built-in's module is
imported only when it is built).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class PluginError(ValueError):
    """A name that stands for nothing; the message starts with ``field`` and says the fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def import_object(spec: str, field: str, what: str = "object") -> Any:
    """``package.module:name`` (``name`` may be dotted) -> the object, imported.

    ``what`` is ``class``, ``function`` (anything callable) or ``object`` (anything);
    every failure is a ``PluginError`` naming ``field``.
    """
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise PluginError(field, f"{spec!r}: write it as package.module:{what}")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or the module itself failing as it loads
        raise PluginError(
            field,
            f"cannot import {module_name!r} for {spec!r} ({type(error).__name__}: {error}); "
            "make it importable where the job runs (e.g. PYTHONPATH in cluster.setup) or fix "
            "the name",
        ) from None
    for part in qualname.split("."):
        target = getattr(target, part, None)
    wrong = {"class": not isinstance(target, type), "function": not callable(target)}
    if target is None or wrong.get(what, False):
        raise PluginError(
            field,
            f"{module_name} has no {what} {qualname!r}; fix the name after the colon in {spec!r}",
        )
    return target


@dataclass(frozen=True)
class Plugin:
    """One built-in: what builds it and what it needs installed."""

    target: str  # package.module:name of the object that builds one
    libraries: tuple[str, ...] = ()  # importable names the job's interpreter must have
    extra: str | None = None  # the pip extra of relax_hpc that installs them


class Registry:
    """The names a config field may take: built-ins, or ``package.module:name``."""

    def __init__(
        self, field: str, kind: str, plugins: Mapping[str, Plugin], what: str = "class"
    ) -> None:
        self.field = field
        self.kind = kind  # a plug-in's kind in messages: "engine", "trainer backend", ...
        self.plugins = dict(plugins)
        self.what = what

    def names(self) -> tuple[str, ...]:
        return tuple(self.plugins)

    def plugin(self, spec: str) -> Plugin:
        """The built-in ``spec`` names, or a user's ``package.module:name`` (nothing imported)."""
        if spec in self.plugins:
            return self.plugins[spec]
        if ":" in spec:
            return Plugin(spec)
        raise PluginError(
            self.field,
            f"{spec!r} is not a built-in {self.kind} ({', '.join(self.plugins)}); user "
            f"{self.kind}s are written as package.module:{self.what.replace('class', 'Class')}",
        )

    def load(self, spec: str) -> Any:
        """The object that builds ``spec``, imported."""
        return import_object(self.plugin(spec).target, self.field, self.what)

    def missing_libraries(self, spec: str) -> list[str]:
        """The libraries ``spec`` needs that this interpreter cannot import (none imported;
        a dotted library's parent package is, by importlib, to find the child)."""
        missing = []
        for library in self.plugin(spec).libraries:
            top = library.split(".")[0]
            if importlib.util.find_spec(top) is None or (
                top != library and importlib.util.find_spec(library) is None
            ):
                missing.append(library)
        return missing

    def check_libraries(self, spec: str, python: str) -> None:
        """``PluginError`` naming the field, ``spec``, the library and the pip extra when
        ``python`` (this interpreter) cannot import what ``spec`` needs."""
        missing = self.missing_libraries(spec)
        if not missing:
            return
        extra = self.plugin(spec).extra
        install = f'pip install -e ".[{extra}]"' if extra else "pip install -e ."
        raise PluginError(
            self.field,
            f"{spec} needs {', '.join(missing)}, which {python} cannot import; install it "
            f"({install}, see README) or choose another {self.kind}",
        )
