"""The small interface every generation engine implements, and its request/result types.

An engine turns token-id prompts into sampled completions with per-token log-probs, takes
new weights tagged with a ``policy_version``, and hands its device memory (weights, KV
cache) to a colocated trainer between batches (``mode=sync``): ``release_memory`` after a
batch; whatever needs the memory again (``generate``, a weight load) takes it back first.

Log-prob convention (all engines): ``logprobs[t]`` is ``log_softmax(logits_t / temperature)``
of the sampled token over the *full* vocabulary: the temperature-scaled policy, before any
top-k/top-p truncation. The trainer recomputes old/new log-probs by dividing its logits by
the same rollout temperature. Greedy decoding reports temperature-1 log-probs.

Sampling randomness is a function of ``(seed, sample_id)`` only: rerunning a request with the
same id regenerates the same completion, whatever else is in the batch.

Must not: score, batch prompts into groups, or know about the spool or the trainer.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from relax_hpc.config.schema import RolloutConfig

FINISH_REASONS = ("stop", "length")  # stop: EOS or a stop string; length: max_new_tokens


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()  # a completion ends with the token that completes one of these
    greedy: bool = False  # argmax decoding (evaluation); temperature/top-p/top-k are ignored
    seed: int = 0  # with a request's sample_id, fixes its random draws

    def __post_init__(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig, seed: int) -> SamplingParams:
        return cls(
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k,
            max_new_tokens=rollout_cfg.max_new_tokens,
            stop=tuple(rollout_cfg.stop),
            seed=seed,
        )

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


@dataclass(frozen=True)
class GenerationRequest:
    sample_id: str  # unique per sample of the run, e.g. "<group>/<k>"; seeds its randomness
    prompt_ids: list[int]
    # engine-specific media for the prompt, e.g. {"image": [...], "audio": [...]}; None = text
    multimodal: dict | None = None


@dataclass
class Completion:
    sample_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # every sampled token, including an EOS or the stop string's tokens
    logprobs: list[float]  # one per token_ids entry (see the module docstring)
    finish_reason: str  # one of FINISH_REASONS
    text: str  # token_ids decoded without special tokens
    policy_version: int
    stop: str | None = field(default=None)  # the stop string that ended it, if any


def sample_seed(seed: int, sample_id: str) -> int:
    """A 63-bit generator seed from ``(seed, sample_id)``, stable across processes and runs."""
    digest = hashlib.blake2b(f"{seed}/{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Engine(abc.ABC):
    """What the rollout loop calls; one instance per rollout worker."""

    policy_version: int = 0

    @abc.abstractmethod
    def generate(
        self, requests: Sequence[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        """One completion per request, in request order."""

    @abc.abstractmethod
    def load_state_dict(
        self,
        named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        policy_version: int,
    ) -> None:
        """Copy (some or all) weights by name; later generations carry ``policy_version``."""

    def release_memory(self) -> None:
        """Free the device memory of the weights and the KV cache for a colocated trainer;
        the weights stay restorable. Idempotent. Engines that hold device memory override
        it; this default refuses, so that a sync run never takes memory as freed that is not."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory (mode=sync)")

    def resume_memory(self) -> None:
        """Undo ``release_memory`` (a no-op when nothing is released). ``generate`` and the
        weight loads call it themselves."""
        return None
