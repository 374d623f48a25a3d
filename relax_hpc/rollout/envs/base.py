"""The environment protocol of multi-turn rollouts, and the types that cross it.

One ``Environment`` instance is one episode (its attributes are the episode's state); the
episode driver (``rollout.multiturn``) builds it as ``cls(runtime)`` and calls::

    reset(row, seed) -> Observation | None     once, before the first turn
    step(action)     -> StepResult              after every model turn

``row`` is the dataset row (``prompt``, ``answer`` and the row's other columns). ``seed`` is
``episode_seed(run seed, sample_id)``: an environment that draws randomness takes it from
``random.Random(seed)``, so a rerun of the sample after a crash replays the same episode.
``reset`` returns None to keep the dataset's prompt, or an ``Observation`` whose messages
(and tool schemas) become the whole prompt, rendered with the chat template. ``step`` gets
the model's turn (``Action``) and answers with the next observation, a reward, and whether
the episode is over. The trajectory's reward is the sum of the step rewards (outcome
environments reward only the last step). ``step`` may block (a tool call): the driver runs
steps in threads, so a slow one holds its episode only. ``close`` runs once at the end.

An exception from ``reset``/``step`` ends the episode with ``end_reason="env_error"`` and
the message in its info; the rollout goes on (the error counts in the metrics).

Options: ``rollout.environment_options`` (a mapping) reaches the environment as
``runtime.options``; a class declares them as the dataclass ``Options`` and reads
``self.options``. Unknown keys are a configuration error, raised at submit time.

Must not: import torch, the engines or the trainer.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from relax_hpc.rollout.tools.sandbox import ToolResult, ToolSandbox

Message = Mapping[str, Any]  # {"role": "user" | "tool" | ..., "content": str}


@dataclass(frozen=True)
class Observation:
    """What the model sees next: chat messages, rendered with the tokenizer's chat template.

    After a step: ``tool`` and/or ``user`` messages. From ``reset``: the whole prompt, with
    ``tools`` (JSON schemas) for templates that describe tools in the prompt (Qwen3). A
    message's content is a text, or typed parts (``{"type": "text", "text": ...}``,
    ``{"type": "image"}``) when the observation carries ``images``.
    """

    messages: tuple[Message, ...] = ()
    tools: tuple[Mapping[str, Any], ...] = ()
    # RGB images (uint8 HxWx3 arrays or PIL), one per ``{"type": "image"}`` content part of
    # ``messages``, in order (a vision model only: the driver expands and sends them).
    images: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Action:
    """One model turn."""

    text: str  # decoded without special tokens
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (end of turn, or a stop string) or "length"
    stop: str | None  # the stop string that ended the turn, if any
    turn: int  # 0 for the first turn


@dataclass(frozen=True)
class StepResult:
    observation: Observation = Observation()
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)  # small, JSON-able; merged per episode
    tool_results: tuple[ToolResult, ...] = ()  # one per tool call of the turn (metrics)


@dataclass(frozen=True)
class EnvRuntime:
    """What every episode of a rollout worker shares."""

    tools: ToolSandbox | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    """Subclass this (or match its shape) for ``rollout.environment: module:Class``."""

    @dataclass(frozen=True)
    class Options:
        """No options; subclasses declare theirs as a frozen dataclass of the same name."""

    stop: tuple[str, ...] = ()  # more stop strings for every turn (e.g. a tool-call closing tag)
    uses_tools: ClassVar[bool] = False  # the driver must be given a ToolSandbox

    def __init__(self, runtime: EnvRuntime) -> None:
        self.runtime = runtime
        self.options = self.parse_options(runtime.options)

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> Any:
        """``options`` as ``cls.Options``; ValueError naming the unknown or bad keys."""
        known = [f.name for f in dataclasses.fields(cls.Options)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(
                f"rollout.environment_options: {cls.__name__} has no option {unknown}; "
                f"its options are {known or 'none'}"
            )
        try:
            return cls.Options(**options)
        except (TypeError, ValueError) as error:
            raise ValueError(f"rollout.environment_options for {cls.__name__}: {error}") from None

    @abc.abstractmethod
    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        """Start the episode for ``row``; None keeps the dataset's prompt."""

    @abc.abstractmethod
    def step(self, action: Action) -> StepResult:
        """React to one model turn."""

    def close(self) -> None:
        """Release what the episode holds (called once, however it ended)."""
        return None


def episode_seed(run_seed: int, sample_id: str) -> int:
    """A 63-bit seed for the environment of ``sample_id``; stable across processes and runs.

    Its own hash domain: the engine seeds sampling from the same pair, and the two streams
    must not be correlated.
    """
    digest = hashlib.blake2b(f"env/{run_seed}/{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
