"""Cross-field and cross-group checks of a composed ``RunConfig``, before anything runs.

Each rule raises ``ConfigError`` naming the field and the fix. Rules that look at the
filesystem (paths that must exist) run only when the job is going to run, not when a
script is merely rendered (``check_paths=False``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import (
    BUILTIN_TOKENIZERS,
    CLUSTER_KINDS,
    DATA_KINDS,
    DTYPES,
    MEDIA_TASKS,
    MEGATRON_CHECKPOINT_FORMATS,
    MODALITIES,
    MODES,
    RESUME_CHOICES,
    ModelConfig,
    RunConfig,
    TrainerConfig,
)
from relax_hpc.config.validate_agents import check_agents
from relax_hpc.config.validate_rewards import check_rewards, judge_paths


def validate_run_config(cfg: RunConfig, check_paths: bool = False) -> None:
    """Raise ``ConfigError`` for the first rule ``cfg`` breaks."""
    _check_choices(cfg)
    _check_positive(cfg)
    _check_ranges(cfg)
    _check_algo(cfg)
    _validate_section("spool", cfg.spool)
    _validate_section("weightsync", cfg.weightsync)
    _check_mode(cfg)
    _check_backends(cfg)
    _check_trainer_layout(cfg.trainer)
    _check_megatron(cfg)
    _check_freeze_vision(cfg)
    _check_weightsync_transport(cfg)
    _check_rollout_layout(cfg)
    _check_batch_shape(cfg)
    _check_cluster(cfg)
    _check_data(cfg)
    check_rewards(cfg)
    check_agents(cfg)
    if check_paths:
        check_paths_exist(cfg)


def _choice(field: str, value: str, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(field, f"{value!r} is not one of {', '.join(allowed)}")


def _check_choices(cfg: RunConfig) -> None:
    _choice("mode", cfg.mode, MODES)
    _choice("resume", cfg.resume, RESUME_CHOICES)
    _choice("model.modality", cfg.model.modality, MODALITIES)
    _choice("model.dtype", cfg.model.dtype, DTYPES)
    _choice(
        "trainer.megatron_checkpoint_format",
        cfg.trainer.megatron_checkpoint_format,
        MEGATRON_CHECKPOINT_FORMATS,
    )
    _choice("data.kind", cfg.data.kind, DATA_KINDS)
    _choice("cluster.kind", cfg.cluster.kind, CLUSTER_KINDS)


def _check_positive(cfg: RunConfig) -> None:
    """Counts that must be at least 1 (GPU counts may be 0 = CPU)."""
    fields = {
        "trainer.nodes": cfg.trainer.nodes,
        "trainer.processes_per_node": cfg.trainer.processes_per_node,
        "trainer.cpus_per_task": cfg.trainer.cpus_per_task,
        "trainer.total_steps": cfg.trainer.total_steps,
        "trainer.mini_batches_per_step": cfg.trainer.mini_batches_per_step,
        "trainer.epochs_per_step": cfg.trainer.epochs_per_step,
        "trainer.micro_batch_tokens": cfg.trainer.micro_batch_tokens,
        "trainer.checkpoint_interval_steps": cfg.trainer.checkpoint_interval_steps,
        "trainer.checkpoint_keep": cfg.trainer.checkpoint_keep,
        "trainer.mem_gb": cfg.trainer.mem_gb,
        "trainer.torch_threads": cfg.trainer.torch_threads,
        "rollout.nodes": cfg.rollout.nodes,
        "rollout.cpus_per_task": cfg.rollout.cpus_per_task,
        "rollout.mem_gb": cfg.rollout.mem_gb,
        "rollout.torch_threads": cfg.rollout.torch_threads,
        "rollout.workers_per_node": cfg.rollout.workers_per_node,
        "rollout.engine_tensor_parallel": cfg.rollout.engine_tensor_parallel,
        "rollout.prompts_per_step": cfg.rollout.prompts_per_step,
        "rollout.n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
        "data.max_prompt_tokens": cfg.data.max_prompt_tokens,
        "data.digits": cfg.data.digits,
        "cluster.time_min": cfg.cluster.time_min,
        "observe.alerts.max_per_hour": cfg.observe.alerts.max_per_hour,
    }
    for name, value in fields.items():
        if value < 1:
            raise ConfigError(name, f"must be >= 1, got {value}")
    for name, value in {
        "trainer.gpus_per_node": cfg.trainer.gpus_per_node,
        "rollout.gpus_per_node": cfg.rollout.gpus_per_node,
        "max_staleness": cfg.max_staleness,
        "cluster.max_restarts": cfg.cluster.max_restarts,
        "rollout.max_restarts": cfg.rollout.max_restarts,
        "rollout.restart_backoff_s": cfg.rollout.restart_backoff_s,
        "cluster.signal_grace_s": cfg.cluster.signal_grace_s,
        "cluster.run_lock_wait_s": cfg.cluster.run_lock_wait_s,
        "trainer.warmup_steps": cfg.trainer.warmup_steps,
        "rollout.eval_interval_steps": cfg.rollout.eval_interval_steps,
        "data.eval_size": cfg.data.eval_size,
        "observe.alerts.log_lines": cfg.observe.alerts.log_lines,
    }.items():
        if value < 0:
            raise ConfigError(name, f"must be >= 0, got {value}")
    if not cfg.rollout.claim_lease_s > 0:
        raise ConfigError(
            "rollout.claim_lease_s",
            f"must be > 0 seconds (how old a worker's heartbeat may be before its prompt "
            f"groups pass to another worker), got {cfg.rollout.claim_lease_s}",
        )


def _check_ranges(cfg: RunConfig) -> None:
    """Real numbers with a range (found here, not when a role starts and is restarted)."""
    trainer, rollout, alerts = cfg.trainer, cfg.rollout, cfg.observe.alerts
    for name, value in {
        "trainer.lr": trainer.lr,
        "trainer.critic_lr": trainer.critic_lr,
        "trainer.grad_clip": trainer.grad_clip,
        "rollout.temperature": rollout.temperature,
        "rollout.reward_timeout_s": rollout.reward_timeout_s,
        "observe.alerts.stall_after_min": alerts.stall_after_min,
        "observe.alerts.send_timeout_s": alerts.send_timeout_s,
        "observe.alerts.poll_s": alerts.poll_s,
    }.items():
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(name, f"must be a number > 0, got {value!r}")
    for name, value in {
        "trainer.weight_decay": trainer.weight_decay,
        "observe.alerts.min_interval_s": alerts.min_interval_s,
    }.items():
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(name, f"must be a number >= 0, got {value!r}")
    _check_fraction("rollout.top_p", rollout.top_p, "the nucleus kept; 1 = off")
    _check_fraction("rollout.engine_mem_fraction", rollout.engine_mem_fraction, "of each GPU")
    if cfg.judge is not None:
        _check_fraction("judge.engine_mem_fraction", cfg.judge.engine_mem_fraction, "of a GPU")
        if cfg.judge.mem_gb < 1:
            raise ConfigError("judge.mem_gb", f"must be >= 1, got {cfg.judge.mem_gb}")
    if rollout.top_k == 0 or rollout.top_k < -1:
        raise ConfigError("rollout.top_k", f"must be -1 (off) or >= 1, got {rollout.top_k}")
    if trainer.parallel.data == 0 or trainer.parallel.data < -1:
        raise ConfigError(
            "trainer.parallel.data",
            f"must be -1 (derived from the processes) or >= 1, got {trainer.parallel.data}",
        )


def _check_fraction(name: str, value: float, what: str) -> None:
    """A share in (0, 1]."""
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ConfigError(name, f"must be in (0, 1] ({what}), got {value!r}")


def _validate_section(prefix: str, section) -> None:
    """Run a component config's own ``validate``; its messages name ``<prefix>.<field>``."""
    try:
        section.validate()
    except ValueError as err:
        match = re.search(rf"{prefix}\.\w+", str(err))
        raise ConfigError(match.group(0) if match else prefix, str(err)) from None


def _check_algo(cfg: RunConfig) -> None:
    _validate_section("algo", cfg.algo)
    if cfg.algo.is_group_based() and cfg.rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            "rollout.n_samples_per_prompt",
            f"algo {cfg.algo.name!r} normalises within a group of completions and needs "
            f">= 2 per prompt, got {cfg.rollout.n_samples_per_prompt}",
        )
    if cfg.algo.opd_coef > 0 and not cfg.model.teacher_path:
        raise ConfigError(
            "model.teacher_path",
            f"algo {cfg.algo.name!r} distils from a teacher (algo.opd_coef > 0); "
            "set model.teacher_path",
        )


def _check_mode(cfg: RunConfig) -> None:
    if cfg.mode == "sync" and cfg.max_staleness != 0:
        raise ConfigError(
            "max_staleness",
            f"mode=sync is strictly on-policy; set max_staleness=0 (got {cfg.max_staleness}) "
            "or use mode=async",
        )
    if cfg.mode == "hybrid" and cfg.max_staleness != 0:
        raise ConfigError(
            "max_staleness",
            f"mode=hybrid is on-policy; set max_staleness=0 (got {cfg.max_staleness}) "
            "or use mode=async",
        )
    if cfg.mode == "async" and cfg.max_staleness < 1:
        raise ConfigError(
            "max_staleness",
            "mode=async lets generation run ahead; set max_staleness >= 1 or use mode=hybrid",
        )
    if cfg.mode == "sync":
        same = (cfg.rollout.nodes, cfg.rollout.gpus_per_node) == (
            cfg.trainer.nodes,
            cfg.trainer.gpus_per_node,
        )
        if not same:
            raise ConfigError(
                "rollout.nodes",
                "mode=sync time-shares the trainer's devices; set rollout.nodes and "
                "rollout.gpus_per_node equal to trainer.nodes and trainer.gpus_per_node",
            )


def _check_backends(cfg: RunConfig) -> None:
    if cfg.trainer.backend == "megatron" and cfg.trainer.gpus_per_node == 0:
        _check_megatron_on_cpu(cfg.trainer)
    if cfg.rollout.backend == "sglang" and cfg.rollout.gpus_per_node == 0:
        raise ConfigError(
            "rollout.backend",
            "sglang needs GPUs; set rollout.gpus_per_node or backend=transformers",
        )
    layout = cfg.trainer.parallel
    for name in ("tensor", "pipeline", "context"):
        if cfg.trainer.backend == "torch" and getattr(layout, name) != 1:
            raise ConfigError(
                f"trainer.parallel.{name}",
                "the torch backend is data parallel only (FSDP2); use trainer.backend=megatron "
                "for tensor/pipeline/context parallelism",
            )


def trainer_world_size(trainer: TrainerConfig) -> int:
    """Trainer processes: one per GPU, or ``processes_per_node`` on CPU nodes."""
    per_node = trainer.gpus_per_node or trainer.processes_per_node
    return trainer.nodes * per_node


def data_parallel_size(trainer: TrainerConfig) -> int:
    """The data-parallel size implied by the layout (call after ``validate_run_config``)."""
    layout = trainer.parallel
    if layout.data > 0:
        return layout.data
    return trainer_world_size(trainer) // (layout.tensor * layout.pipeline * layout.context)


def _check_trainer_layout(trainer: TrainerConfig) -> None:
    layout = trainer.parallel
    for name in ("tensor", "pipeline", "context", "expert"):
        if getattr(layout, name) < 1:
            raise ConfigError(f"trainer.parallel.{name}", "must be >= 1")
    world = trainer_world_size(trainer)
    model_parallel = layout.tensor * layout.pipeline * layout.context
    processes = "GPUs" if trainer.gpus_per_node else "processes"
    if layout.data > 0 and model_parallel * layout.data != world:
        raise ConfigError(
            "trainer.parallel.data",
            f"tensor x pipeline x context x data = {model_parallel * layout.data} but the "
            f"trainer has {world} {processes} (nodes x per node); make them equal",
        )
    if world % model_parallel:
        raise ConfigError(
            "trainer.parallel.tensor",
            f"tensor x pipeline x context = {model_parallel} does not divide the trainer's "
            f"{world} {processes}",
        )
    data = data_parallel_size(trainer)
    if (data * layout.context) % layout.expert:
        raise ConfigError(
            "trainer.parallel.expert",
            f"expert parallel {layout.expert} must divide data x context = {data * layout.context}",
        )


def _check_megatron_on_cpu(trainer: TrainerConfig) -> None:
    """Megatron on CPU is one process (a laptop run of the Megatron code path): Megatron's
    DDP, distributed optimizer and pipeline schedule are CUDA-only."""
    layout = trainer.parallel
    sizes = (layout.tensor, layout.pipeline, layout.context, layout.expert, max(layout.data, 1))
    if trainer_world_size(trainer) != 1 or sizes != (1, 1, 1, 1, 1):
        raise ConfigError(
            "trainer.backend",
            "megatron on CPU trains in one process with every trainer.parallel size 1 "
            f"(got {trainer_world_size(trainer)} processes, tensor/pipeline/context/expert/"
            f"data {'/'.join(map(str, sizes))}); set trainer.gpus_per_node for more, or "
            "trainer.backend=torch (data parallel on CPU)",
        )
    if trainer.activation_checkpointing:
        raise ConfigError(
            "trainer.activation_checkpointing",
            "megatron on CPU cannot recompute activations (Megatron saves CUDA RNG states "
            "for it); set trainer.activation_checkpointing=false",
        )


def _check_freeze_vision(cfg: RunConfig) -> None:
    if cfg.trainer.freeze_vision and cfg.model.modality not in ("vision", "omni"):
        raise ConfigError(
            "trainer.freeze_vision",
            f"model.modality={cfg.model.modality} has no vision tower to freeze; set "
            "trainer.freeze_vision=false (or a vision / omni model)",
        )
    if cfg.trainer.freeze_audio and cfg.model.modality not in ("audio", "omni"):
        raise ConfigError(
            "trainer.freeze_audio",
            f"model.modality={cfg.model.modality} has no audio tower to freeze; set "
            "trainer.freeze_audio=false (or an audio / omni model)",
        )


def _check_megatron(cfg: RunConfig) -> None:
    """What the megatron backend does not run yet."""
    if cfg.trainer.backend != "megatron":
        return
    if cfg.model.modality != "text":
        raise ConfigError(
            "trainer.backend",
            f"megatron cannot carry model.modality={cfg.model.modality}: its HF <-> Megatron "
            "mapping is text-only (no vision/audio tower); use trainer.backend=torch (FSDP2, "
            "CPU or GPU) for this model",
        )
    if cfg.model.dtype == "float16":
        raise ConfigError(
            "model.dtype",
            "the megatron backend trains in bfloat16 or float32 (it has no float16 loss "
            "scaler); set model.dtype=bfloat16",
        )
    # The same test as relax_hpc.algo.resolve(...).needs_critic, without importing the losses.
    needs_critic = cfg.algo.with_algorithm_defaults().advantage_estimator == "gae"
    if needs_critic and cfg.trainer.parallel.pipeline > 1:
        raise ConfigError(
            "trainer.parallel.pipeline",
            f"algo {cfg.algo.name!r} trains a critic, which the megatron backend runs without "
            "pipeline parallelism; set trainer.parallel.pipeline=1 (tensor, context, expert "
            "and data parallelism work) or use a critic-free algo such as grpo",
        )


def _check_weightsync_transport(cfg: RunConfig) -> None:
    """SGLang's distributed update needs SGLang engines on GPUs of their own."""
    sync = cfg.weightsync
    if sync.transport == "sglang_distributed" and cfg.rollout.backend != "sglang":
        raise ConfigError(
            "weightsync.transport",
            "sglang_distributed broadcasts into SGLang's own update group and needs "
            f"rollout.backend=sglang (got {cfg.rollout.backend!r}); use weightsync.transport=buckets",
        )
    if sync.transport == "sglang_distributed" and cfg.mode == "sync":
        raise ConfigError(
            "weightsync.transport",
            "sglang_distributed puts trainer rank 0 and an SGLang worker on the same GPU in "
            "mode=sync, which NCCL refuses; use weightsync.transport=buckets for co-located runs",
        )
    # Only async mode sends in the background (sync and hybrid wait for the version anyway:
    # there the setting has no effect, so that +experiment=grpo_tiny mode=sync just works).
    if sync.background_send and cfg.mode == "async" and sync.transport != "buckets":
        raise ConfigError(
            "weightsync.background_send",
            "a send overlapped with training needs transport=buckets (got "
            f"transport={sync.transport!r}); set weightsync.background_send=false",
        )
    if sync.transport == "buckets" and sync.backend == "nccl":
        raise ConfigError(
            "weightsync.backend",
            "the bucket transport's receivers stage weights in host memory, so it runs over "
            "gloo; use weightsync.backend=auto, or weightsync.transport=sglang_distributed for "
            "NCCL straight into SGLang",
        )


def _check_rollout_layout(cfg: RunConfig) -> None:
    rollout = cfg.rollout
    if rollout.gpus_per_node and rollout.gpus_per_node % rollout.engine_tensor_parallel:
        raise ConfigError(
            "rollout.engine_tensor_parallel",
            f"{rollout.gpus_per_node} rollout GPUs per node are not divisible by the engine's "
            f"tensor-parallel size {rollout.engine_tensor_parallel}",
        )
    if not rollout.gpus_per_node and rollout.engine_tensor_parallel != 1:
        raise ConfigError(
            "rollout.engine_tensor_parallel", "CPU rollout engines run unsharded; set it to 1"
        )


def _check_batch_shape(cfg: RunConfig) -> None:
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    data = data_parallel_size(cfg.trainer)
    per_update = data * cfg.trainer.mini_batches_per_step
    if samples % per_update:
        raise ConfigError(
            "rollout.prompts_per_step",
            f"a step's {samples} samples (prompts_per_step x n_samples_per_prompt) do not split "
            f"evenly into {cfg.trainer.mini_batches_per_step} mini-batches x {data} "
            "data-parallel ranks; change prompts_per_step or trainer.mini_batches_per_step",
        )


def _check_cluster(cfg: RunConfig) -> None:
    cluster = cfg.cluster
    if cluster.signal_grace_s >= cluster.time_min * 60:
        raise ConfigError(
            "cluster.signal_grace_s",
            f"{cluster.signal_grace_s} s of warning does not fit in a {cluster.time_min} min "
            "time limit; lower it or raise cluster.time_min",
        )
    if cfg.mode != "sync" and cluster.share_nodes and cfg.trainer.nodes != cfg.rollout.nodes:
        raise ConfigError(
            "cluster.share_nodes",
            "sharing nodes needs trainer.nodes == rollout.nodes; give the roles the same "
            "node count or set share_nodes=false for a heterogeneous job",
        )
    for key in cluster.extra_sbatch:
        if key.startswith("-") or "=" in key or not key:
            raise ConfigError(
                f"cluster.extra_sbatch.{key}",
                "use the bare option name as the key, e.g. {constraint: a100}",
            )


def _check_data(cfg: RunConfig) -> None:
    if cfg.data.kind in ("jsonl", "parquet") and not cfg.data.path:
        raise ConfigError("data.path", f"data.kind={cfg.data.kind} needs a path to the prompts")
    _check_media_data(cfg)
    if cfg.model.modality != "text":
        _check_built_in_media_model(cfg.model)
        return
    if cfg.model.path is None and not cfg.model.arch:
        raise ConfigError(
            "model.path", "set a local Hugging Face folder, or model.arch to build from a config"
        )
    if cfg.model.path is None and cfg.model.tokenizer == "auto":
        raise ConfigError(
            "model.tokenizer", "a model built from model.arch needs tokenizer=char or a folder"
        )


def _check_built_in_media_model(model: ModelConfig) -> None:
    """A media model without a folder is the tiny built-in one of its architecture
    (``models/multimodal.py``): ``model.arch`` only overrides its config (empty is fine),
    and its tokenizer is its processor's."""
    if model.path is None and model.tokenizer != "auto":
        raise ConfigError(
            "model.tokenizer",
            f"a built-in {model.modality} model brings its own tokenizer and processor "
            "(models/multimodal.py); set model.tokenizer=auto",
        )


def _check_media_data(cfg: RunConfig) -> None:
    data = cfg.data
    for name in ("max_media_bytes", "max_image_pixels", "max_audio_s"):
        if not getattr(data, name) > 0:
            raise ConfigError(
                f"data.{name}", f"must be > 0 (a limit per media item), got {getattr(data, name)}"
            )
    text_only = cfg.model.modality == "text"
    if cfg.rollout.environment and cfg.model.modality not in ("text", "vision"):
        raise ConfigError(
            "rollout.environment",
            f"multi-turn episodes carry text and images, not a {cfg.model.modality} model's "
            "audio; run it single-turn (rollout.environment=null)",
        )
    if data.blank_media and text_only:
        raise ConfigError(
            "data.blank_media",
            "blanks the images of a vision model's prompts, but model.modality=text reads no "
            "media; set model.modality (and a vision model) or data.blank_media=false",
        )
    if data.kind == "media_task":
        _choice("data.media_task", data.media_task, MEDIA_TASKS)
        if text_only:
            raise ConfigError(
                "data.kind",
                f"media_task ({data.media_task}) prompts hold media, but model.modality=text; "
                "use a vision (shapes) or audio (pitch) model",
            )
        if data.eval_size < 4 or data.eval_size % 4:
            raise ConfigError(
                "data.eval_size",
                f"media_task needs a positive multiple of 4 (balanced classes), "
                f"got {data.eval_size}",
            )


def check_paths_exist(cfg: RunConfig) -> None:
    """Paths the run will read must exist (checked when running, not when rendering)."""
    candidates = {
        "model.path": cfg.model.path,
        "model.reference_path": cfg.model.reference_path,
        "model.teacher_path": cfg.model.teacher_path,
        "model.critic_path": cfg.model.critic_path,
        "data.path": cfg.data.path,
        "data.eval_path": cfg.data.eval_path,
    }
    if cfg.model.tokenizer not in ("auto", *BUILTIN_TOKENIZERS):
        candidates["model.tokenizer"] = cfg.model.tokenizer
    candidates.update(judge_paths(cfg))
    for name, value in candidates.items():
        if value and not Path(value).expanduser().exists():
            raise ConfigError(name, f"{value} does not exist; fix the path or override {name}=")
