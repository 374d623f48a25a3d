"""Configuration of weight sync: one plain dataclass, validated before any job starts.

Owns the knobs of ``relax_hpc.weightsync`` only. Must not import Hydra or torch; the
config schema package registers this dataclass, jobs receive it as their sub-config.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "gloo", "nccl")
SERVE_DTYPES = ("bfloat16", "float16", "float32", "same")
TRANSPORTS = ("buckets", "sglang_distributed")


@dataclass
class WeightSyncConfig:
    """Weight sync between the trainer (rank 0) and the rollout engines.

    backend: ``auto`` picks NCCL when the trainer's device is CUDA, else Gloo.
    timeout_s: bound of every phase of a sync (ready, group formation, each bucket, results).
    busy_timeout_s: the most an engine that is alive (its liveness connection open) may take
        to answer a round's call: in async mode it finishes the batch it is generating
        first, which on a large model takes minutes. An engine without the connection gets
        ``timeout_s``.
    busy_steps: within that, an alive engine may take this many times the longest recent
        step (the time between two syncs) to answer, at least ``busy_floor_s``; a hung
        engine (stopped, connection open) is dropped after this and rejoins when it runs
        again. 0: always ``busy_timeout_s``.
    busy_floor_s: the least that bound is, however short the steps: an engine descheduled
        for a moment on a loaded node is not a hung one (a wrong drop costs a rejoin).
    bucket_mb: size of one flat send buffer; tensors are packed into such buckets.
    interval_steps: the trainer syncs every ``interval_steps`` optimizer steps.
    serve_dtype: floating-point tensors are converted to it on the sender (``same`` keeps them).
    fs_fallback: publish weights/v{N}/ when a sync reaches no engine or some engine failed.
    fs_every_syncs: also publish every N syncs (0 = only as fallback), for joiners and debugging.
    fs_keep_versions: published versions kept on disk; older ones are deleted by the trainer.
    advertise_host: address engines use to reach the trainer ("" = this host's FQDN).
    port: TCP port of the trainer's rendezvous store (0 = any free port).
    poll_s: sleep between checks of a condition (store keys, files).
    background_send: in mode=async, the trainer sends each version from a thread while it
        reads the next batch and trains (``trainer/publish.py``), instead of between two
        steps. Costs a host copy of the weights; needs transport=buckets. No effect in sync
        and hybrid modes (they wait for the version anyway). On in ``grpo_tiny`` (measured
        there: +14% samples/s); off by default until measured on GPUs.
    send_process: with background_send on the bucket transport over Gloo, the sending runs
        in a child process of the trainer (``weightsync/sender_process.py``) rather than a
        thread: a thread competes with the training loop for Python's GIL (measured on
        grpo_tiny, 2 cores: the async step 1.25x its training time with the thread). The
        child owns the rendezvous store and the liveness port. Linux only (the weights
        pass through a memfd); elsewhere, and with false, a thread.
    transport: ``buckets`` (``WeightSender``/``WeightReceiver``: packed buckets, checksummed
        on the receiver) or ``sglang_distributed`` (``per_tensor``: one broadcast per tensor
        straight into SGLang's tensor-parallel workers; rollout.backend must be sglang).
    """

    backend: str = "auto"
    timeout_s: float = 60.0
    busy_timeout_s: float = 3600.0
    busy_steps: float = 4.0
    busy_floor_s: float = 10.0
    bucket_mb: int = 256
    interval_steps: int = 1
    serve_dtype: str = "bfloat16"
    fs_fallback: bool = True
    fs_every_syncs: int = 0
    fs_keep_versions: int = 2
    advertise_host: str = ""
    port: int = 0
    poll_s: float = 0.02
    transport: str = "buckets"
    background_send: bool = False
    send_process: bool = True

    def validate(self) -> WeightSyncConfig:
        """Raise ``ValueError`` naming the first bad field as ``weightsync.<field>``."""
        checks = (
            ("backend", self.backend in BACKENDS, f"one of {', '.join(BACKENDS)}"),
            ("timeout_s", self.timeout_s > 0, "a positive number of seconds"),
            ("busy_timeout_s", self.busy_timeout_s >= self.timeout_s, "at least timeout_s"),
            ("busy_steps", self.busy_steps >= 0, "0 (always busy_timeout_s) or a positive factor"),
            (
                "busy_floor_s",
                0 < self.busy_floor_s <= self.busy_timeout_s,
                "a positive number of seconds, at most busy_timeout_s",
            ),
            ("bucket_mb", self.bucket_mb >= 1, "at least 1"),
            ("interval_steps", self.interval_steps >= 1, "at least 1"),
            ("serve_dtype", self.serve_dtype in SERVE_DTYPES, f"one of {', '.join(SERVE_DTYPES)}"),
            ("fs_every_syncs", self.fs_every_syncs >= 0, "0 (fallback only) or a positive count"),
            ("fs_keep_versions", self.fs_keep_versions >= 1, "at least 1"),
            ("port", 0 <= self.port <= 65535, "0 (any free port) or a TCP port"),
            ("poll_s", 0 < self.poll_s <= self.timeout_s, "positive and at most timeout_s"),
            ("transport", self.transport in TRANSPORTS, f"one of {', '.join(TRANSPORTS)}"),
        )
        for field, ok, expected in checks:
            if not ok:
                value = getattr(self, field)
                raise ValueError(f"weightsync.{field}={value!r} is invalid: expected {expected}")
        return self


def run_backend(config: WeightSyncConfig, trainer_on_gpu: bool) -> str:
    """The backend a run's trainer sends with, once the run's layout is known.

    ``sglang_distributed`` broadcasts into SGLang's GPU workers: NCCL on a GPU trainer. The
    bucket transport's receivers (``rollout.weights``) stage in host memory for every engine
    (SGLang loads host tensors through ``update_weights_from_tensor``), so it runs over Gloo,
    which also works where trainer and engines share GPUs (``mode=sync``).
    """
    if config.backend != "auto":
        return config.backend
    if config.transport == "sglang_distributed" and trainer_on_gpu:
        return "nccl"
    return "gloo"
