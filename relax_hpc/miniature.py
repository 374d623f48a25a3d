"""``+preset=miniature``: any experiment shrunk to run on a laptop CPU through the same code path.

``miniaturize`` (pure) turns a composed experiment into its miniature:

- model: a tiny model of the same architecture family built from config
  (``TINY_ARCHITECTURES``), with the built-in character tokenizer; no warm start;
- trainer: the torch backend in one CPU process, two steps, a checkpoint at step 2;
- rollout: the transformers engine in one CPU worker, 2 prompts x 2 samples, <= 8 new tokens;
- data: a few rows in the recipe's schema (``relax_hpc.data.schemas``), which
  ``write_miniature_data`` writes into the run directory; a held-out file when the recipe
  evaluates;
- ``cluster=local`` with no restarts (a fault shows at once), weights over buckets (Gloo);
- no alerts: a smoke test on a laptop does not page the team's channel (the run watcher
  still runs and keeps the cost ledger);
- judge: a tiny model of the judge's family on the rollout's engine (transformers), not
  warm-started: its verdicts are noise (mostly *failed*, with the reason) but every sample
  goes through the recipe's template, verdict parser and composition;
- reward models: a tiny sequence classifier of each one's ``architecture`` built from config
  (``num_labels`` up to its label), not warm-started: its scores are noise, but every
  sample goes through the recipe's template, label, normalization and composition.

What the miniature checks stays the recipe's own: reward (and its weights, judge template
and verdict), algorithm, mode and staleness, data schema and keys, chat template setting.
A vision family's tiny model is the built-in tiny one of ``models.multimodal`` (the same
sizes, not warm-started) and its file data carries PNG images in the recipe's schema.
An omni family's tiny model is the built-in tiny thinker (a whole Qwen3-Omni class maps to
its thinker's family) and its file data carries PNG images and WAV clips in one row.

Must not: import torch or transformers (submit applies it right after composition).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from relax_hpc.config import ConfigError, ParallelConfig, RunConfig
from relax_hpc.data.schemas import SCHEMAS, example_rows, write_rows

STEPS = 2
PROMPTS_PER_STEP = 2
SAMPLES_PER_PROMPT = 2  # the smallest group the group-based estimators accept
MAX_NEW_TOKENS = 8
TRAIN_ROWS = 4
EVAL_ROWS = 2
SPOOL_POLL_S = 0.05

_TINY_QWEN3 = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,  # a DAPO prompt is ~400 characters = tokens
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}
# Modalities a miniature runs (resolve.RUNNABLE_MODALITIES: the trainer and engines carry them)
MINIATURE_MODALITIES = ("text", "vision", "audio", "omni")
MEDIA_TASK_EVAL_ROWS = 4  # media_task splits are balanced over 4 classes
# The tiny model of each architecture family, as config kwargs of its transformers class
# (a media family's: nested kwargs deep-merged over models.multimodal.TINY_ARCH).
TINY_ARCHITECTURES: dict[str, dict] = {
    "Qwen3VLForConditionalGeneration": {"text_config": {"hidden_size": 64, "num_hidden_layers": 2}},
    "Qwen2_5OmniThinkerForConditionalGeneration": {},  # models.multimodal.TINY_ARCH as is
    "Qwen3OmniMoeForConditionalGeneration": {},  # its thinker's TINY_ARCH (MoE, 2 layers)
    "Qwen3ForCausalLM": _TINY_QWEN3,
    "Qwen3ForSequenceClassification": _TINY_QWEN3,  # a reward model's score head
    "Qwen3MoeForCausalLM": {
        **_TINY_QWEN3,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


def miniaturize(cfg: RunConfig, data_dir: Path) -> RunConfig:
    """The miniature of ``cfg``; its data files are to be written under ``data_dir``."""
    if cfg.model.modality not in MINIATURE_MODALITIES:
        raise ConfigError(
            "model.modality",
            f"the miniature of {cfg.name} cannot run yet: {cfg.model.architecture} takes "
            f"{cfg.model.modality} input, which the CPU path does not carry",
        )
    if cfg.model.architecture not in TINY_ARCHITECTURES:
        raise ConfigError(
            "model.architecture",
            f"no tiny model of {cfg.model.architecture} is defined for a miniature (known: "
            f"{', '.join(TINY_ARCHITECTURES)}); add one to relax_hpc/miniature.py",
        )
    if cfg.model.teacher_path:
        raise ConfigError(
            "model.teacher_path",
            "a miniature builds no tiny teacher yet; run on-policy distillation at full size",
        )
    return replace(
        cfg,
        model=_tiny_model(cfg),
        trainer=_cpu_trainer(cfg),
        rollout=_cpu_rollout(cfg),
        data=_few_rows(cfg, data_dir),
        cluster=replace(cfg.cluster, kind="local", max_restarts=0),
        weightsync=replace(cfg.weightsync, transport="buckets", backend="auto"),
        spool=replace(cfg.spool, poll_s=min(cfg.spool.poll_s, SPOOL_POLL_S)),
        observe=replace(cfg.observe, alerts=replace(cfg.observe.alerts, events=[])),
        judge=_tiny_judge(cfg),
        rewards=replace(cfg.rewards, reward_models=_tiny_reward_models(cfg)),
    )


def _tiny_reward_models(cfg: RunConfig) -> dict:
    """Each reward model as a tiny one of its ``architecture`` built from config, with the
    recipe's template, label and normalization; not warm-started (its scores are noise)."""
    tiny = {}
    for name, rm in cfg.rewards.reward_models.items():
        if rm.architecture not in TINY_ARCHITECTURES:
            raise ConfigError(
                f"rewards.reward_models.{name}.architecture",
                f"no tiny model of {rm.architecture} is defined for a miniature (known: "
                f"{', '.join(TINY_ARCHITECTURES)}); add one to relax_hpc/miniature.py",
            )
        tiny[name] = replace(
            rm,
            path=None,
            arch={**TINY_ARCHITECTURES[rm.architecture], "num_labels": rm.label + 1},
            tokenizer="char",
            warm_start="none",
            dtype="float32",
            batch_size=min(rm.batch_size, PROMPTS_PER_STEP * SAMPLES_PER_PROMPT),
            max_length=min(rm.max_length, _TINY_QWEN3["max_position_embeddings"]),
        )
    return tiny


def _tiny_judge(cfg: RunConfig):
    judge = cfg.judge
    if judge is None:
        return None
    architecture = judge.model.architecture
    if architecture not in TINY_ARCHITECTURES:
        raise ConfigError(
            "judge.model.architecture",
            f"no tiny model of {architecture} is defined for a miniature (known: "
            f"{', '.join(TINY_ARCHITECTURES)}); add one to relax_hpc/miniature.py",
        )
    return replace(
        judge,
        model=replace(
            judge.model,
            path=None,
            arch=dict(TINY_ARCHITECTURES[architecture]),
            tokenizer="char",
            dtype="float32",
        ),
        warm_start="none",
        placement="rollout",
        backend="transformers",
        gpus_per_node=0,
        engine_tensor_parallel=1,
        max_new_tokens=min(judge.max_new_tokens, MAX_NEW_TOKENS),
        torch_threads=1,
    )


def _tiny_model(cfg: RunConfig):
    return replace(
        cfg.model,
        path=None,
        arch=dict(TINY_ARCHITECTURES[cfg.model.architecture]),
        # a built-in media model's tokenizer is its processor's (models/multimodal.py)
        tokenizer="char" if cfg.model.modality == "text" else "auto",
        dtype="float32",  # CPU arithmetic
        reference_path=None,
        critic_path=None,
        warm_start=False,
    )


def _cpu_trainer(cfg: RunConfig):
    samples = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    mini_batches = cfg.trainer.mini_batches_per_step
    return replace(
        cfg.trainer,
        backend="torch",
        nodes=1,
        gpus_per_node=0,
        processes_per_node=1,
        cpus_per_task=1,
        mem_gb=2,
        parallel=ParallelConfig(),
        total_steps=STEPS,
        checkpoint_interval_steps=STEPS,
        mini_batches_per_step=mini_batches if samples % mini_batches == 0 else 1,
        torch_threads=1,
    )


def _cpu_rollout(cfg: RunConfig):
    return replace(
        cfg.rollout,
        backend="transformers",
        nodes=1,
        gpus_per_node=0,
        workers_per_node=1,
        engine_tensor_parallel=1,
        cpus_per_task=1,
        mem_gb=2,
        prompts_per_step=PROMPTS_PER_STEP,
        n_samples_per_prompt=SAMPLES_PER_PROMPT,
        max_new_tokens=min(cfg.rollout.max_new_tokens, MAX_NEW_TOKENS),
        torch_threads=1,
    )


def _few_rows(cfg: RunConfig, data_dir: Path):
    rows = MEDIA_TASK_EVAL_ROWS if cfg.data.kind == "media_task" else EVAL_ROWS
    data = replace(cfg.data, eval_size=min(cfg.data.eval_size, rows))
    if data.kind not in ("jsonl", "parquet"):
        return data  # a built-in task needs no files
    evaluates = cfg.rollout.eval_interval_steps > 0
    return replace(
        data,
        path=str(data_dir / f"train.{data.kind}"),
        eval_path=str(data_dir / f"eval.{data.kind}") if evaluates else None,
    )


def write_miniature_data(cfg: RunConfig) -> list[Path]:
    """Write the rows a miniature's data config points at (kept when already there)."""
    data = cfg.data
    schema = SCHEMAS[data.schema]
    rows = example_rows(schema, data.prompt_key, data.answer_key)
    written = []
    for path, count, first in ((data.path, TRAIN_ROWS, 0), (data.eval_path, EVAL_ROWS, TRAIN_ROWS)):
        if path and not Path(path).is_file():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            written.append(write_rows(rows(count, first), Path(path), data.kind, schema))
    return written


def describe_miniature(cfg: RunConfig) -> str:
    """The line that tells a person this run is a miniature, and what that means."""
    if cfg.data.kind in ("jsonl", "parquet"):
        data = f"{TRAIN_ROWS} rows of {cfg.data.schema} data"
    else:
        data = f"the built-in {cfg.data.kind} task"
    judge = f", a tiny {cfg.judge.model.architecture} judge" if cfg.judge is not None else ""
    if cfg.rewards.reward_models:
        judge += f", {len(cfg.rewards.reward_models)} tiny reward model(s)"
    return (
        f"MINIATURE run of {cfg.name} (+preset=miniature): a tiny {cfg.model.architecture} "
        f"built from config{judge}, the torch trainer and the transformers engine on CPU, {data}, "
        f"{cfg.trainer.total_steps} steps, cluster=local. It checks the configuration and the "
        "plumbing, not the recipe's results."
    )
