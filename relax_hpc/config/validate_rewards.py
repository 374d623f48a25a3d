"""Checks of the reward sections (``rewards``, ``judge``) that need no imports.

Whether each *name* stands for something (a reward function, a model folder) is checked by
``relax_hpc.resolve``; these rules look at values and at how the sections fit the rest of
the run. Each raises ``ConfigError`` naming the field and the fix.
"""

from __future__ import annotations

from pathlib import Path

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import (
    DTYPES,
    JUDGE_PLACEMENTS,
    JUDGE_VERDICTS,
    JUDGE_WARM_STARTS,
    JudgeConfig,
    RunConfig,
)

# Policy engine + judge engine on one GPU (SGLang's static fractions) must leave room for
# activations and the CUDA context.
MAX_SHARED_MEM_FRACTION = 0.9


def check_rewards(cfg: RunConfig) -> None:
    try:
        cfg.rewards.validate(cfg.rollout.reward)
    except ValueError as err:
        text = str(err)
        raise ConfigError(text.split(" ")[0].rstrip(":"), text) from None
    for name, rm in cfg.rewards.reward_models.items():
        if rm.warm_start == "addition_scorer" and cfg.data.kind != "synthetic_addition":
            raise ConfigError(
                f"rewards.reward_models.{name}.warm_start",
                f"addition_scorer scores the synthetic addition task, not data.kind="
                f"{cfg.data.kind}; use a reward model of your own (path)",
            )
    if cfg.judge is not None:
        check_judge(cfg.judge, cfg)


def check_judge(judge: JudgeConfig, cfg: RunConfig) -> None:
    for name, value, allowed in (
        ("placement", judge.placement, JUDGE_PLACEMENTS),
        ("verdict", judge.verdict, JUDGE_VERDICTS),
        ("warm_start", judge.warm_start, JUDGE_WARM_STARTS),
        ("model.dtype", judge.model.dtype, DTYPES),
    ):
        if value not in allowed:
            raise ConfigError(f"judge.{name}", f"{value!r} is not one of {', '.join(allowed)}")
    for name in ("max_new_tokens", "batch_size", "nodes", "cpus_per_task", "torch_threads"):
        if getattr(judge, name) < 1:
            raise ConfigError(f"judge.{name}", f"must be >= 1, got {getattr(judge, name)}")
    for name in ("max_restarts", "restart_backoff_s"):
        if getattr(judge, name) < 0:
            raise ConfigError(f"judge.{name}", f"must be >= 0, got {getattr(judge, name)}")
    if not judge.hang_after_s > 0:
        raise ConfigError(
            "judge.hang_after_s",
            f"must be > 0 seconds (how old the judge's status may be before its keeper "
            f"restarts it), got {judge.hang_after_s}",
        )
    try:
        judge.client.validate("judge.client")
    except ValueError as err:
        raise ConfigError(str(err).split(" ")[0], str(err)) from None
    _check_verdict(judge)
    _check_judge_model(judge, cfg)
    _check_judge_placement(judge, cfg)


def _check_verdict(judge: JudgeConfig) -> None:
    if judge.verdict == "score":
        low_high = judge.score_range
        if len(low_high) != 2 or not low_high[0] < low_high[1]:
            raise ConfigError(
                "judge.score_range", f"must be [low, high] with low < high, got {low_high}"
            )
    if judge.verdict == "letter" and not judge.letter_scores:
        raise ConfigError(
            "judge.letter_scores",
            "verdict=letter needs the score of each letter, e.g. {A: 1, B: 0}",
        )
    if not all(len(letter) == 1 and letter.isalpha() for letter in judge.letter_scores):
        raise ConfigError("judge.letter_scores", "keys must be single letters, e.g. {A: 1, B: 0}")


def _check_judge_model(judge: JudgeConfig, cfg: RunConfig) -> None:
    model = judge.model
    if model.path is None and not model.arch:
        raise ConfigError(
            "judge.model.path", "set a local Hugging Face folder, or judge.model.arch"
        )
    if model.path is None and model.tokenizer == "auto":
        raise ConfigError(
            "judge.model.tokenizer", "a judge built from arch needs tokenizer=char or a folder"
        )
    if judge.warm_start == "addition_verifier":
        if model.path is not None:
            raise ConfigError(
                "judge.warm_start",
                "addition_verifier trains a model built from judge.model.arch; set "
                "judge.model.path=null or judge.warm_start=none",
            )
        if cfg.data.kind != "synthetic_addition":
            raise ConfigError(
                "judge.warm_start",
                f"addition_verifier verifies the synthetic addition task, not data.kind="
                f"{cfg.data.kind}; use a judge model of your own (judge.model.path)",
            )
    if judge.backend == "sglang" and model.path is None:
        raise ConfigError(
            "judge.backend", "sglang serves a local Hugging Face folder; set judge.model.path"
        )


def _check_judge_placement(judge: JudgeConfig, cfg: RunConfig) -> None:
    if judge.placement == "component":
        _check_judge_component(judge)
        return
    rollout = cfg.rollout
    if judge.backend == "sglang" and not rollout.gpus_per_node:
        raise ConfigError(
            "judge.backend",
            "placement=rollout runs the judge on the rollout's devices, which are CPUs; use "
            "judge.backend=transformers or give the rollout GPUs",
        )
    shared = rollout.engine_mem_fraction + judge.engine_mem_fraction
    if (
        judge.backend == "sglang"
        and rollout.backend == "sglang"
        and shared > MAX_SHARED_MEM_FRACTION
    ):
        raise ConfigError(
            "judge.engine_mem_fraction",
            f"the judge's engine shares the policy engine's GPUs: rollout.engine_mem_fraction "
            f"{rollout.engine_mem_fraction} + judge.engine_mem_fraction "
            f"{judge.engine_mem_fraction} > {MAX_SHARED_MEM_FRACTION}; lower one of them",
        )
    if judge.backend == "sglang" and judge.engine_tensor_parallel != rollout.engine_tensor_parallel:
        raise ConfigError(
            "judge.engine_tensor_parallel",
            "on the rollout's engines the judge uses the same GPUs as each policy engine; set "
            f"it to rollout.engine_tensor_parallel ({rollout.engine_tensor_parallel})",
        )


def _check_judge_component(judge: JudgeConfig) -> None:
    """The judge on nodes of its own: one server task per engine (per node on CPU)."""
    if judge.gpus_per_node < 0 or judge.engine_tensor_parallel < 1:
        raise ConfigError(
            "judge.gpus_per_node",
            f"needs gpus_per_node >= 0 and engine_tensor_parallel >= 1, got "
            f"{judge.gpus_per_node} and {judge.engine_tensor_parallel}",
        )
    if judge.backend == "sglang" and not judge.gpus_per_node:
        raise ConfigError(
            "judge.gpus_per_node",
            "judge.backend=sglang serves on GPUs: give the judge's component GPUs "
            "(judge.gpus_per_node) or use judge.backend=transformers",
        )
    if judge.gpus_per_node % judge.engine_tensor_parallel:
        raise ConfigError(
            "judge.engine_tensor_parallel",
            f"judge.gpus_per_node {judge.gpus_per_node} is not a multiple of "
            f"engine_tensor_parallel {judge.engine_tensor_parallel}: each judge task serves "
            "on engine_tensor_parallel GPUs of its node",
        )


def judge_paths(cfg: RunConfig) -> dict[str, str]:
    """Paths the judge and the reward models read, by field (checked when the job runs)."""
    found: dict[str, str] = {}
    if cfg.judge is not None and cfg.judge.model.path:
        found["judge.model.path"] = cfg.judge.model.path
    for name, rm in cfg.rewards.reward_models.items():
        if rm.path is not None:
            found[f"rewards.reward_models.{name}.path"] = rm.path
    for name, endpoint in cfg.rewards.endpoints.items():
        if endpoint.token_file:
            found[f"rewards.endpoints.{name}.token_file"] = endpoint.token_file
    return {field: str(Path(value).expanduser()) for field, value in found.items()}
