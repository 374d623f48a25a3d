"""Generation with SGLang's offline engine: one ``sglang.Engine`` per tensor-parallel group.

Why the in-process ``sglang.Engine`` and not an HTTP server: the rollout worker already is
the process Slurm starts for one engine, so a server would only add a port to pick, a
readiness probe, JSON (de)serialization of every token and log-prob, and a second process
tree to clean up on preemption. The offline engine runs the same tokenizer manager,
scheduler (one subprocess per TP rank) and detokenizer as the server, its control calls
(weight updates, memory release, pause) are plain method calls, and tensors handed to
``update_weights_from_tensor`` reach the schedulers through torch IPC instead of HTTP.

Request building and response parsing live in ``sglang_adapter`` (pure, unit-tested on CPU
against fixtures in SGLang's 0.5.6.post2 shapes); this module only calls the engine. Imports
of sglang are lazy, so the module imports on a CPU box without it.

Contract with ``engines/base.py``:
- log-probs: SGLang's default sampler reports ``log(softmax(logits / T))`` before
  top-k/top-p and temperature-1 log-probs for greedy, our convention
  (``SGLANG_RETURN_ORIGINAL_LOGPROB`` is refused at construction).
- per-sample seeds: every request carries ``sampling_seed = sample_seed(seed, sample_id)``
  when the installed SGLang has that field, but SGLang honours it only with
  ``enable_deterministic_inference`` (``deterministic_sampling=True``, PyTorch sampling
  backend, batch-invariant kernels, slower). Without it SGLang samples from its own
  generator and a rerun of a sample id may differ: a known gap, not hidden.
- ``policy_version`` changes only after SGLang reported a successful weight update.
- colocation (``memory_saver=True``, ``mode=sync``): ``release_memory`` releases every
  memory kind SGLang tracks (weights, KV cache, CUDA graphs; the weights are kept in a CPU
  backup); a weight update first resumes the weights only (SGLang cannot write into
  released memory), ``generate`` resumes the rest.
- finish reasons: SGLang checks ``max_new_tokens`` before EOS, so an EOS drawn as the very
  last allowed token reports ``"length"`` here where the transformers engine says
  ``"stop"``; the tokens and log-probs are the same.

Verified on CPU: request building, response parsing, and this class's bookkeeping against
a stand-in engine (tests/unit/rollout/test_sglang_adapter.py). Written against the API and
only checked on a GPU by tests/gpu/test_sglang_engine.py: the real ``sglang.Engine``
calls, ``update_weights_from_tensor`` with CPU tensors, ``update_weights_from_disk`` on a
``weights/v{N}/`` folder (which has no config.json: SGLang keeps the served model's
config), and the distributed update group.

Must not: score, touch the spool, or import the trainer.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from relax_hpc.media.processor import MediaProcessor
from relax_hpc.rollout.engines.base import Completion, Engine, GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.sglang_adapter import (
    check_logprob_environment,
    chunks_by_bytes,
    distributed_update_args,
    generate_kwargs,
    media_logit_bias,
    parse_completions,
    request_ids,
    require_success,
)
from relax_hpc.rollout.engines.sglang_media import sglang_media_requests

WEIGHT_UPDATE_GROUP = "relax_hpc_weights"
WEIGHTS_MEMORY = "weights"  # SGLang's GPU_MEMORY_TYPE_WEIGHTS
# SGLang's GPU_MEMORY_ALL_TYPES (sglang.srt.constants) where it cannot be imported.
ALL_MEMORY = ("kv_cache", "weights", "cuda_graph")
UPDATE_CHUNK_BYTES = 1 << 30  # per weight-update call (see sglang_adapter.chunks_by_bytes)
# Layouts where an engine has more ranks than its tensor-parallel group, or ranks that
# SGLang numbers differently in a weight-update group.
ONE_TP_GROUP_ONLY = frozenset({"pp_size", "dp_size", "enable_dp_attention"})


class SGLangEngine(Engine):
    def __init__(
        self,
        model_path: str | Path,
        tensor_parallel: int = 1,
        mem_fraction: float = 0.85,
        dtype: str = "auto",
        seed: int = 0,
        policy_version: int = 0,
        deterministic_sampling: bool = False,
        memory_saver: bool = False,
        extra_server_args: Mapping[str, Any] | None = None,
        launch: Callable[..., Any] | None = None,
        seeded: bool | None = None,
        media_processor: MediaProcessor | None = None,
    ) -> None:
        """``launch(**server_args)`` builds the engine (default ``sglang.Engine``; tests
        pass a stand-in); ``seeded`` overrides the detection of ``sampling_seed``.
        ``media_processor`` (a vision model's, from the same folder) turns requests' images
        into SGLang processor outputs and masks the media tokens (``sglang_media``).
        ``memory_saver`` is needed for ``release_memory`` to free anything (colocation);
        ``extra_server_args`` go to SGLang's ``ServerArgs`` as they are (e.g.
        ``attention_backend``, ``disable_cuda_graph``).
        """
        check_logprob_environment(os.environ)
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        if not 0 < mem_fraction < 1:
            raise ValueError(f"mem_fraction must be in (0, 1), got {mem_fraction}")
        self.model_path = str(model_path)
        self.tensor_parallel = tensor_parallel  # processes joining a weight-update group
        self.policy_version = policy_version
        self.memory_saver = memory_saver
        server_args = {
            "model_path": self.model_path,
            "tp_size": tensor_parallel,
            "mem_fraction_static": mem_fraction,
            "dtype": dtype,
            "random_seed": seed,
            "skip_tokenizer_init": False,  # stop strings and text need SGLang's tokenizer
            "enable_memory_saver": memory_saver,
        }
        if deterministic_sampling:
            server_args["enable_deterministic_inference"] = True
        if memory_saver:  # else the weights come back empty after a release/resume
            server_args["enable_weights_cpu_backup"] = True
        unsupported = sorted(set(extra_server_args or {}) & ONE_TP_GROUP_ONLY)
        if unsupported:
            raise ValueError(
                f"SGLang server args {unsupported}: one engine is one tensor-parallel group "
                "here (its weight-update ranks are tp_size); run more engines instead"
            )
        server_args.update(extra_server_args or {})
        self._engine = (launch or _launch_sglang)(**server_args)
        self._seeded = _sampling_seed_supported() if seeded is None else seeded
        self.media_processor = media_processor
        self._logit_bias = (
            media_logit_bias(media_processor.media_token_ids) if media_processor else None
        )
        self._num_calls = 0
        self._released: list[str] = []  # memory kinds handed to a colocated trainer

    # --- generation ----------------------------------------------------------------------------
    def generate(
        self, requests: Sequence[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        """One batched call; SGLang schedules the batch itself (continuous batching).

        Raises ``SGLangAborted`` when a request was aborted (``abort_in_flight``): no
        partial completion is ever returned.
        """
        if not requests:
            return []
        self.resume_memory()
        self._num_calls += 1
        rids = request_ids(requests, self._num_calls)
        if self.media_processor is not None:
            requests = sglang_media_requests(requests, self.media_processor)
        kwargs = generate_kwargs(requests, params, rids, self._seeded, self._logit_bias)
        outputs = self._engine.generate(**kwargs)
        return parse_completions(outputs, requests, rids, params, self.policy_version)

    def abort_in_flight(self) -> None:
        """Abort every in-flight request (drain); safe to call from another thread."""
        abort = functools.partial(self._engine.tokenizer_manager.abort_request, abort_all=True)
        if self._engine.loop.is_running():
            # generate() is blocked on this loop in another thread: run the abort inside it
            self._engine.loop.call_soon_threadsafe(abort)
        else:
            abort()

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling (``abort``: in-flight requests end as aborted) before an update."""
        manager = self._engine.tokenizer_manager
        try:
            from sglang.srt.managers.io_struct import PauseGenerationReqInput
        except ImportError:  # sglang 0.5.5: pause_generation() takes no argument
            self._run(manager.pause_generation())
        else:
            self._run(manager.pause_generation(PauseGenerationReqInput(mode=mode)))

    def continue_generation(self) -> None:
        manager = self._engine.tokenizer_manager
        try:
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput
        except ImportError:  # sglang 0.5.5: continue_generation() takes no argument
            self._run(manager.continue_generation())
        else:
            self._run(manager.continue_generation(ContinueGenerationReqInput()))

    def flush_cache(self) -> None:
        """Drop the prefix (radix) cache: its KV entries were computed by older weights."""
        require_success(self._engine.flush_cache(), "flush_cache")

    # --- weights ------------------------------------------------------------------------------
    def load_state_dict(
        self,
        named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        policy_version: int,
    ) -> None:
        self.push_tensors(named_tensors)
        self.policy_version = policy_version

    def push_tensors(
        self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]
    ) -> None:
        """``update_weights_from_tensor``, flushing the prefix cache; the version is unchanged.

        Returns once the schedulers loaded the tensors, so the caller may reuse their
        buffers afterwards (the weight receiver's staging buckets).
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        self._resume([WEIGHTS_MEMORY])
        chunks = chunks_by_bytes(list(items), _tensor_bytes, UPDATE_CHUNK_BYTES)
        for index, chunk in enumerate(chunks):
            result = self._engine.update_weights_from_tensor(
                named_tensors=chunk, flush_cache=index == len(chunks) - 1
            )
            require_success(result, "update_weights_from_tensor")

    def update_weights_from_disk(self, model_dir: str | Path, policy_version: int) -> None:
        """Load every ``*.safetensors`` of ``model_dir`` (SGLang flushes the cache itself)."""
        self._resume([WEIGHTS_MEMORY])
        result = self._engine.update_weights_from_disk(model_path=str(model_dir))
        require_success(result, f"update_weights_from_disk({model_dir})")
        self.policy_version = policy_version

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "nccl",
        group_name: str = WEIGHT_UPDATE_GROUP,
    ) -> None:
        """Join a process group whose rank 0 (the trainer) broadcasts tensors one by one."""
        result = self._engine.init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        require_success(result, "init_weights_update_group")

    def update_weights_from_distributed(
        self,
        specs: Iterable[Any],
        policy_version: int | None,
        group_name: str = WEIGHT_UPDATE_GROUP,
    ) -> None:
        """Receive the tensors of ``specs`` (``name``/``dtype``/``shape``, broadcast order).

        ``policy_version=None`` leaves the version to the caller (the weight receiver stamps
        it after its own checks).
        """
        chunks = chunks_by_bytes(list(specs), _spec_bytes, UPDATE_CHUNK_BYTES)
        self._resume([WEIGHTS_MEMORY])
        for index, chunk in enumerate(chunks):  # the trainer broadcasts in this same order
            result = self._engine.update_weights_from_distributed(
                group_name=group_name,
                flush_cache=index == len(chunks) - 1,
                **distributed_update_args(chunk),
            )
            require_success(result, "update_weights_from_distributed")
        if policy_version is not None:
            self.policy_version = policy_version

    def destroy_weights_update_group(self, group_name: str = WEIGHT_UPDATE_GROUP) -> None:
        """Leave a weight-update group (SGLang 0.5.6 has the call; older versions do not)."""
        destroy = getattr(self._engine, "destroy_weights_update_group", None)
        if destroy is not None:
            require_success(destroy(group_name=group_name), "destroy_weights_update_group")

    # --- memory and lifetime -------------------------------------------------------------------
    def release_memory(self) -> None:
        if not self.memory_saver:
            raise ValueError("release_memory needs SGLangEngine(memory_saver=True)")
        tags = [kind for kind in _memory_kinds() if kind not in self._released]
        if not tags:
            return
        result = self._engine.release_memory_occupation(tags=tags)
        require_success(result, f"release_memory_occupation({tags})")
        self._released += tags

    def resume_memory(self) -> None:
        self._resume(list(self._released))

    def _resume(self, kinds: list[str]) -> None:
        """Take back those of ``kinds`` that are released (SGLang refuses a double resume)."""
        tags = [kind for kind in self._released if kind in kinds]
        if not tags:
            return
        result = self._engine.resume_memory_occupation(tags=tags)
        require_success(result, f"resume_memory_occupation({tags})")
        self._released = [kind for kind in self._released if kind not in tags]

    def shutdown(self) -> None:
        self._engine.shutdown()

    def _run(self, coroutine) -> Any:
        """Run a tokenizer-manager coroutine, also while generate() holds the loop in
        another thread (then inside that loop)."""
        loop = self._engine.loop
        if loop.is_running():
            return asyncio.run_coroutine_threadsafe(coroutine, loop).result()
        return loop.run_until_complete(coroutine)


def _tensor_bytes(item: tuple[str, Tensor]) -> int:
    return item[1].numel() * item[1].element_size()


def _spec_bytes(spec: Any) -> int:
    import torch

    return spec.numel * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()


def _launch_sglang(**server_args: Any) -> Any:
    import sglang

    return sglang.Engine(**server_args)


def _memory_kinds() -> list[str]:
    """What ``release_memory_occupation()`` without tags releases."""
    try:
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
    except ImportError:  # no sglang here (CPU tests with a stand-in engine)
        return list(ALL_MEMORY)
    return list(GPU_MEMORY_ALL_TYPES)


def _sampling_seed_supported() -> bool:
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    return "sampling_seed" in inspect.signature(SGLangSamplingParams).parameters
