"""``rollout.environment``: a built-in name or a user's ``module:Class``, resolved and checked.

``resolve_environment`` is what submit-time validation calls: it imports the class, checks
that it has the protocol's methods, that it can be built as ``cls(runtime)``, and that
``rollout.environment_options`` are options it declares. Every failure is a ``ValueError``
naming the field, the known choices and the fix. Built-ins are named by import path, so
resolving one imports only that environment.

Must not: build environments or start tools (that is the rollout's job, at start).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from relax_hpc.plugins import Plugin, PluginError, Registry
from relax_hpc.rollout.envs.base import EnvRuntime

FIELD = "rollout.environment"
ENVIRONMENTS = Registry(
    FIELD,
    "environment",
    {
        "brighter": Plugin("relax_hpc.rollout.envs.brighter:BrighterEnv"),
        "calculator": Plugin("relax_hpc.rollout.envs.calculator:CalculatorEnv"),
        "guess_number": Plugin("relax_hpc.rollout.envs.guess_number:GuessNumberEnv"),
        "python_math": Plugin("relax_hpc.rollout.envs.python_math:PythonMathEnv"),
    },
)
BUILTIN_ENVIRONMENTS = ENVIRONMENTS.names()


def resolve_environment(spec: str, options: Mapping[str, Any] | None = None) -> type:
    """The environment class of ``spec``; ``options`` are checked against its ``Options``."""
    cls = _import_class(spec)
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(
            f"{FIELD}: {spec} has no {' or '.join(missing)} method; an environment implements "
            "reset(row, seed) and step(action) (see relax_hpc.rollout.envs.base.Environment)"
        )
    try:
        inspect.signature(cls).bind(EnvRuntime())
    except (TypeError, ValueError):
        raise ValueError(
            f"{FIELD}: {spec} cannot be built as {cls.__name__}(runtime); its __init__ must "
            "take one argument, the EnvRuntime"
        ) from None
    parse = getattr(cls, "parse_options", None)
    if parse is not None:
        parse(dict(options or {}))
    elif options:
        raise ValueError(
            f"rollout.environment_options: {spec} takes no options (it has no parse_options)"
        )
    return cls


def _import_class(spec: str) -> type:
    """The class a built-in name or ``package.module:Class`` stands for."""
    try:
        return ENVIRONMENTS.load(spec)
    except PluginError as err:
        raise ValueError(str(err)) from None
