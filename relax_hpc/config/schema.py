"""Typed configuration: one plain dataclass per Hydra group, composed into ``RunConfig``.

YAML under ``configs/`` supplies values; these classes fix the names, types and defaults.
Choice fields are ``str`` (OmegaConf has no ``Literal``); ``relax_hpc.config.validate``
checks every choice and every cross-group rule with a message that names the field.
Units are in the names (``mem_gb``, ``time_min``, ``grace_s``).

Component code receives these dataclasses (or its own sub-config), never an OmegaConf
object: nothing here imports Hydra or OmegaConf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relax_hpc.config.algo import AlgoConfig
from relax_hpc.config.rewards import ClientConfig, RewardsConfig
from relax_hpc.config.spool import SpoolConfig
from relax_hpc.config.weightsync import WeightSyncConfig

MISSING: Any = "???"  # OmegaConf's marker for a required value

MODES = ("sync", "hybrid", "async")
MODALITIES = ("text", "vision", "audio", "omni")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# How Megatron's distributed optimizer writes checkpoints (trainer/megatron/layout.py).
MEGATRON_CHECKPOINT_FORMATS = ("dp_reshardable", "fully_reshardable")
# rollout: the judge's engine runs in each rollout worker, on its devices | component: the
# judge is a component of its own (own nodes), reached over HTTP through the run directory
JUDGE_PLACEMENTS = ("rollout", "component")
JUDGE_WARM_STARTS = ("none", "addition_verifier")
JUDGE_VERDICTS = ("yes_no", "score", "letter")
MEDIA_TASKS = ("shapes", "pitch")  # relax_hpc/data/media_tasks.py
DATA_KINDS = ("jsonl", "parquet", "synthetic_addition", "guess_number", "media_task")
CLUSTER_KINDS = ("local", "slurm", "auto")
RESUME_CHOICES = ("auto", "never")
# model.tokenizer values built in code (relax_hpc/models/tokenizer.py), not read from a folder
BUILTIN_TOKENIZERS = ("char", "char_tools")


@dataclass
class ModelConfig:
    """The policy model. Either a local Hugging Face folder (``path``) or built from ``arch``."""

    name: str = MISSING
    path: str | None = None  # local HF folder (config, weights, tokenizer); never downloaded
    architecture: str = "Qwen3ForCausalLM"  # transformers class, used when building from arch
    arch: dict[str, Any] = field(default_factory=dict)  # config kwargs when path is None
    # auto = from path | char = built-in offline tokenizer (char_tools: with the tool-call
    # tags as single tokens) | a folder
    tokenizer: str = "auto"
    modality: str = "text"  # text | vision | audio | omni
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on GPU
    reference_path: str | None = None  # reference policy for KL/TIS; None = the initial policy
    teacher_path: str | None = None  # teacher for on-policy distillation
    critic_path: str | None = None  # critic body for PPO; None = the initial policy (+ value head)
    # Supervised warm start on the synthetic task before RL (built-in models only); cached
    # under $RELAX_HPC_CACHE_DIR (default ~/.cache/relax_hpc) so that it runs once.
    warm_start: bool = False


@dataclass
class ParallelConfig:
    """Trainer parallel layout; tensor x pipeline x context x data = trainer processes."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1  # must divide data x context
    data: int = -1  # -1 = derived from the trainer's processes


@dataclass
class TrainerConfig:
    # torch (CPU or GPU, FSDP2) | megatron (GPU) | package.module:Class (trainer/registry.py)
    backend: str = "torch"
    nodes: int = 1
    gpus_per_node: int = 0  # 0 = CPU training
    processes_per_node: int = 1  # CPU only; on GPU one process per GPU
    cpus_per_task: int = 2
    mem_gb: int = 8
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    total_steps: int = 100
    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    mini_batches_per_step: int = 1  # optimizer steps per batch of samples
    epochs_per_step: int = 1  # passes over one step's samples
    micro_batch_tokens: int = 16384  # token budget of one forward/backward
    critic_lr: float = 1e-5
    activation_checkpointing: bool = False
    checkpoint_interval_steps: int = 50
    checkpoint_keep: int = 2  # complete checkpoints kept; older ones are deleted
    # megatron: dp_reshardable (fast; resume with other data sizes only) | fully_reshardable
    # (gathers the optimizer state at save; resume with any parallel layout)
    megatron_checkpoint_format: str = "dp_reshardable"
    torch_threads: int = 1  # CPU: one thread per process is fastest for tiny models
    # A vision-language / omni policy's vision tower is not trained (no gradient, no optimiser
    # state) and not sent to the engines, which keep the tower they were built with.
    freeze_vision: bool = False
    # An audio / omni policy's audio tower, likewise: not trained, not sent.
    freeze_audio: bool = False


@dataclass
class ToolSandboxConfig:
    """The worker processes that run an environment's tool calls (``rollout/tools``)."""

    num_workers: int = 4  # calls in flight at once per rollout worker
    timeout_s: float = 10.0  # per call; the worker is killed (and replaced) after it
    max_output_bytes: int = 8192  # longer output is cut and marked truncated
    memory_mb: int = 2048  # address-space cap of a tool worker


@dataclass
class RolloutConfig:
    # transformers (CPU or one GPU) | sglang (GPU) | package.module:Builder
    # (rollout/engines/registry.py)
    backend: str = "transformers"
    nodes: int = 1
    gpus_per_node: int = 0
    workers_per_node: int = 1  # CPU only; on GPU one engine per tensor-parallel group
    engine_tensor_parallel: int = 1
    cpus_per_task: int = 2
    mem_gb: int = 8
    prompts_per_step: int = 16  # prompts (groups) consumed by one training step
    n_samples_per_prompt: int = 8  # completions per prompt = group size
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    reward: str = "exact_match"  # a name in the reward registry, or module:function
    reward_timeout_s: float = 10.0
    engine_mem_fraction: float = 0.85  # sglang: static memory fraction of each GPU
    eval_interval_steps: int = 10  # greedy held-out eval every N policy versions (0 = off)
    torch_threads: int = 1
    # A worker's claims on prompt groups (rollout/assignment.py) pass to another worker when
    # its heartbeat (every claim_lease_s / 4) is this old: it died or hangs.
    claim_lease_s: float = 120.0
    # A worker that crashes, or hangs (its heartbeat older than claim_lease_s), is restarted
    # in place by its task's keeper (launch/keeper.py) while the trainer trains: at most this
    # many times per task, after a backoff that doubles from restart_backoff_s; one more
    # failure ends the run as failed (no restart can be expected to help).
    max_restarts: int = 3
    restart_backoff_s: float = 2.0
    # Multi-turn (agentic) rollouts (docs/agents.md). null: one completion per sample, scored
    # by rollout.reward. Else a built-in environment (calculator | guess_number |
    # python_math) or a user's package.module:Class, resolved at submit; it rewards its own
    # episodes (rollout.reward is then not used).
    environment: str | None = None
    environment_options: dict[str, Any] = field(default_factory=dict)  # its Options fields
    max_turns: int = 4  # model turns per episode
    max_episode_tokens: int = 512  # response tokens per episode: model + observation
    episode_timeout_s: float = 300.0  # wall time per episode, tools included
    tools: ToolSandboxConfig = field(default_factory=ToolSandboxConfig)


@dataclass
class JudgeConfig:
    """A generative reward model (an LLM judge): a frozen model whose verdict is the reward.

    Its weights are never synced (it is not the policy). It reads ``template`` filled with
    the prompt, the response, the reference answer and the row's columns, answers greedily
    in at most ``max_new_tokens``, and ``verdict`` turns the answer into a score:
    ``yes_no`` (1 / 0), ``score`` (a number in ``score_range``, mapped to 0..1), ``letter``
    (``letter_scores``). An answer it cannot parse scores 0 as failed, with the reason.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    # addition_verifier: train a built-in model (judge.model.arch) to verify additions
    # first, cached like the policy's warm start (relax_hpc/tasks/verifier.py)
    warm_start: str = "none"
    placement: str = "rollout"  # rollout | component (see JUDGE_PLACEMENTS)
    # transformers (CPU or one GPU) | sglang (GPU) | package.module:Builder
    # (rollout/engines/registry.py)
    backend: str = "transformers"
    template: str = "correctness"  # a built-in template name, or text with {response}
    apply_chat_template: bool = True  # wrap the filled template as a user message
    verdict: str = "yes_no"  # yes_no | score | letter
    score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    letter_scores: dict[str, float] = field(default_factory=lambda: {"A": 1.0, "B": 0.0})
    max_new_tokens: int = 16
    batch_size: int = 64  # judge prompts per forward batch
    # Resources of the judge's own component (placement=component), and of its engine
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem_gb: int = 8
    engine_tensor_parallel: int = 1
    engine_mem_fraction: float = 0.25  # sglang; beside the policy's engine it shares the GPU
    torch_threads: int = 1
    # A judge server of its own (placement=component) that crashes, or hangs (its status
    # older than hang_after_s), is restarted in place by its keeper at most max_restarts
    # times, after a backoff doubling from restart_backoff_s; the rollout finds the new one.
    max_restarts: int = 3
    restart_backoff_s: float = 2.0
    hang_after_s: float = 120.0
    # The rollout's client of a judge in its own component
    client: ClientConfig = field(default_factory=ClientConfig)


@dataclass
class DataConfig:
    kind: str = "synthetic_addition"  # jsonl | parquet | synthetic_addition
    path: str | None = None  # training prompts (jsonl/parquet)
    eval_path: str | None = None  # held-out prompts
    # A published layout (relax_hpc/data/schemas.py: dapo_math | geo3k | prompt_label) that
    # fixes the keys below and the image column, or custom (the keys as given).
    schema: str = "custom"
    prompt_key: str = "prompt"  # dotted keys reach into nested columns
    answer_key: str = "answer"
    system_prompt: str | None = None
    apply_chat_template: bool = True
    shuffle: bool = True
    max_prompt_tokens: int = 1024
    eval_size: int = 256
    digits: int = 2  # synthetic_addition: operand digits
    guess_range: list[int] = field(default_factory=lambda: [1, 20])  # guess_number: low, high
    media_task: str = "shapes"  # media_task: shapes (count shapes in an image) | pitch (audio)
    # Media of a vision/audio model's rows (relax_hpc/data/media_prompts.py). The image
    # column when data.schema names none (geo3k's is its own: images); each item encoded
    # bytes, {bytes, path} or a path relative to the data file, one or a list per row.
    image_key: str = "images"
    audio_key: str = "audio"
    # Per item, checked before decoding; a row over a limit is skipped and counted.
    max_media_bytes: int = 64 * 2**20
    max_image_pixels: int = 40_000_000  # width x height of a source image
    max_audio_s: float = 30.0
    # The control run: every image replaced by a uniform grey image of the same size (every
    # clip by silence), prompts and answers unchanged: what a model learns without seeing.
    blank_media: bool = False


@dataclass
class ClusterConfig:
    kind: str = "auto"  # local | slurm | auto (= slurm when sinfo answers, else local)
    partition: str | None = None
    trainer_partition: str | None = None  # default: partition
    rollout_partition: str | None = None  # default: partition
    judge_partition: str | None = None  # judge.placement=component; default: partition
    account: str | None = None
    qos: str | None = None
    time_min: int = 240
    share_nodes: bool = False  # hybrid/async: split the same nodes' GPUs instead of a hetjob
    signal_grace_s: int = 120  # advance warning before the time limit, for a final checkpoint
    max_restarts: int = 3  # automatic requeues (crash, preemption) before a clear failure
    # A start waits this long for the run directory's lock (a dead holder's NFS lease)
    run_lock_wait_s: int = 120
    setup: list[str] = field(default_factory=list)  # shell lines before the steps (modules, env)
    # Interpreter of the job steps; None = the one that ran submit (sys.executable, resolved
    # at submission and written to config.yaml). A name like "python" is looked up on PATH.
    python: str | None = None
    extra_sbatch: dict[str, str] = field(default_factory=dict)  # additional #SBATCH --key=value
    # Local runs: bind each task to its role's cpus_per_task CPUs of its own, as Slurm's task
    # affinity does, when all fit and the roles run side by side (launch/cpu_binding.py).
    bind_cpus: bool = True


ALERT_EVENTS = (
    "submitted",
    "started",
    "first_step",
    "checkpoint",
    "requeued",
    "resumed",
    "stalled",
    "recovered",
    "failed",
    "cancelled",
    "finished",
)


@dataclass
class AlertConfig:
    """Apprise notifications. The URLs are secrets: they never appear in config.yaml.

    Taken from, in order: ``urls`` (moved at submit time into a 0600 file of the run
    directory, see ``paths.alert_urls_file``), the file ``urls_file`` (one URL per line),
    and the environment variable named by ``urls_env`` (space or comma separated).
    """

    urls: list[str] = field(default_factory=list)
    urls_file: str | None = None
    urls_env: str = "RELAX_HPC_ALERT_URLS"
    events: list[str] = field(
        default_factory=lambda: [e for e in ALERT_EVENTS if e != "checkpoint"]
    )
    stall_after_min: float = 30.0  # no new trainer step for this long -> "stalled"
    min_interval_s: float = 60.0  # the same event kind at most this often
    max_per_hour: int = 30  # all events together; failed and finished always go out
    log_lines: int = 20  # last lines of the failing component's log in a "failed" alert
    send_timeout_s: float = 30.0  # one delivery attempt; a slow service never blocks the job
    poll_s: float = 5.0  # how often the run watcher looks at the run directory


@dataclass
class ObserveConfig:
    alerts: AlertConfig = field(default_factory=AlertConfig)
    # Keep every trained sample id per step in the checkpointed progress and write them to
    # status/consumed_sample_ids.json at the end (or a stop): the exactly-once audit of tests.
    audit_sample_ids: bool = False


@dataclass
class RunConfig:
    """The whole run. ``experiment`` YAML files set ``name`` and the groups."""

    name: str = MISSING
    seed: int = 1
    mode: str = "async"  # sync | hybrid | async
    max_staleness: int = 1  # policy versions generation may run ahead (async >= 1)
    output_root: str = "runs"
    run_dir: str | None = None  # default: <output_root>/<name>-<timestamp>
    resume: str = "auto"  # auto = continue from the latest complete checkpoint | never
    # +preset=miniature: the same experiment shrunk to run on a laptop CPU in seconds
    # (relax_hpc/miniature.py): tiny model of the same family, CPU backends, a few rows of
    # data in the recipe's schema, two steps, cluster=local.
    miniature: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    spool: SpoolConfig = field(default_factory=SpoolConfig)
    weightsync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    # Reward composition, reward models and remote endpoints (config/rewards.py), and the
    # judge (null: none; configs/judge/ has the shipped ones)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    judge: JudgeConfig | None = None
