"""``python_math``: tool-integrated reasoning, a math problem with a Python interpreter.

For GPU recipes on DAPO-Math style data (``prompt``: a string or chat messages, ``answer``).
The prompt is re-rendered with the tool's schema, so templates that describe tools (Qwen3's
``<tools>`` system block) show it. The model may call ``python`` with ``{"code": ...}``;
the program runs in ``tools.python_exec`` (fresh interpreter, no network by default, time,
memory and output limits; read that module for what it does not isolate) and its output is
the tool response. A turn without a tool call is the final answer, scored by the reward
named in ``Options.reward`` (the same names as ``rollout.reward``; default ``math``).

Must not: import torch or the engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relax_hpc.rollout.envs.base import Action, Observation, StepResult
from relax_hpc.rollout.envs.tool_env import ToolEnvironment, ToolSpec, string_parameter
from relax_hpc.rollout.tools.python_exec import NETWORK_MODES


class PythonMathEnv(ToolEnvironment):
    stop_at_tool_call = True

    @dataclass(frozen=True)
    class Options:
        reward: str = "math"
        timeout_s: float = 5.0  # per program; keep it below the sandbox's own timeout
        max_output_bytes: int = 2048
        memory_mb: int = 1024
        network: str = "isolated"  # or "allow" (see tools.python_exec)

        def __post_init__(self) -> None:
            if self.network not in NETWORK_MODES:
                raise ValueError(f"network must be one of {NETWORK_MODES}, got {self.network!r}")
            if self.timeout_s <= 0 or self.max_output_bytes < 1 or self.memory_mb < 64:
                raise ValueError("timeout_s, max_output_bytes must be positive, memory_mb >= 64")

    def tool_specs(self) -> Sequence[ToolSpec]:
        options = self.options
        return (
            ToolSpec(
                name="python",
                function="relax_hpc.rollout.tools.python_exec:run_python",
                description="Run a Python program; you see what it prints (stdout and stderr).",
                parameters=string_parameter("code", "the program"),
                bound={
                    "timeout_s": options.timeout_s,
                    "max_output_bytes": options.max_output_bytes,
                    "memory_mb": options.memory_mb,
                    "network": options.network,
                },
            ),
        )

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        self.answer = str(row["answer"])
        self.metadata = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        schemas = tuple(spec.schema() for spec in self.tool_specs())
        return Observation(tuple(dict(m) for m in messages), schemas)

    def finish(self, action: Action) -> StepResult:
        # Imported here: the reward registry is rollout-side and math-verify is slow to load.
        from relax_hpc.rollout.rewards import call_reward, resolve_reward

        result = call_reward(
            resolve_reward(self.options.reward), action.text, self.answer, self.metadata
        )
        info = {"reward_failed": result.failed} if result.failed else {}
        return StepResult(reward=result.score, done=True, info=info)
