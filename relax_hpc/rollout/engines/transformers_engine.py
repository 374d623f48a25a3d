"""Generation with a transformers causal LM: batched, KV-cached, per-sample reproducible.

Our own decoding loop over ``model(..., past_key_values=cache)`` rather than
``model.generate``, because the random draws must belong to the sample, not to the batch:
each request gets a CPU ``torch.Generator`` seeded by ``sample_seed(seed, sample_id)``, and
its token ``t`` is picked by its generator's ``t``-th float64 uniform (all drawn up front,
one call per request), by inverse CDF over the
(temperature-scaled, top-k/top-p-truncated) distribution in float64. A rerun of the same
``sample_id`` therefore regenerates the same completion whatever the batch order or size
(up to float round-off in the logits, which would have to land within ~1e-7 of a CDF
boundary to change a token). Prompts are left-padded; finished rows leave the batch and the
KV cache. Log-probs follow the convention in ``engines/base.py``: ``log_softmax(logits / T)``
of the sampled token, before top-k/top-p.

Colocation (``release_memory``): every parameter and buffer storage is copied to host memory
(pinned on a GPU) and its device storage is freed (resized to zero bytes, so every view of
it, including the receiver's, stays valid); ``resume_memory`` reallocates and copies back.
The host copy is kept rather than waiting for the next weights, because a worker may
generate again without new weights (another worker's batch advanced the policy) and
buffers (RoPE tables) are never sent. The KV cache lives only inside ``generate``. On a CPU
engine the host copy lives in the same memory: colocation there shares cores, not memory.

Must not: score completions, touch the spool, or import the trainer.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.rollout.engines.base import (
    Completion,
    Engine,
    GenerationRequest,
    SamplingParams,
    sample_seed,
)


class TransformersEngine(Engine):
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        policy_version: int = 0,
        max_batch_size: int = 256,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.policy_version = policy_version
        self.max_batch_size = max_batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.stop_token_ids = _eos_ids(model, tokenizer)
        self.device = next(self.model.parameters()).device
        self.builds_own_masks = has_plain_causal_sdpa_masks(self.model.config)
        # While released: each freed device storage and its host copy.
        self._host_copies: list[tuple[torch.UntypedStorage, Tensor]] | None = None

    def generate(
        self, requests: Sequence[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        self.resume_memory()
        completions: list[Completion] = []
        for start in range(0, len(requests), self.max_batch_size):
            completions += self._generate_batch(
                requests[start : start + self.max_batch_size], params
            )
        return completions

    def load_state_dict(
        self,
        named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        policy_version: int,
    ) -> None:
        self.load_weights(named_tensors)
        self.policy_version = policy_version

    def load_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]):
        """Copy weights by name (the weight receiver's ``load_fn``); the version is unchanged."""
        self.resume_memory()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        targets = self.model.state_dict()  # shares storage with the parameters
        with torch.no_grad():
            for name, tensor in items:
                if name not in targets:
                    raise ValueError(f"weight {name!r} is not a parameter of the rollout model")
                if targets[name].shape != tensor.shape:
                    raise ValueError(
                        f"weight {name!r}: shape {tuple(tensor.shape)} != "
                        f"{tuple(targets[name].shape)} of the rollout model"
                    )
                targets[name].copy_(tensor)

    def release_memory(self) -> None:
        if self._host_copies is not None:
            return
        pinned = self.device.type == "cuda"
        _own_storages(self.model)
        self._host_copies = []
        for storage in _unique_storages(self.model):
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            host.untyped_storage().copy_(storage)
            storage.resize_(0)
            self._host_copies.append((storage, host))
        if pinned:
            torch.cuda.empty_cache()  # hand the freed blocks back to the device

    def resume_memory(self) -> None:
        if self._host_copies is None:
            return
        for storage, host in self._host_copies:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        self._host_copies = None

    @torch.no_grad()
    def _generate_batch(
        self, requests: Sequence[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        if any(not r.prompt_ids for r in requests):
            raise ValueError("every request needs at least one prompt token")
        input_ids_BL, mask_BL = self._left_pad([r.prompt_ids for r in requests])
        cache = DynamicCache()
        logits_BV, next_position_B = self._prefill(requests, input_ids_BL, mask_BL, cache)
        uniforms_BT = None if params.greedy else _uniforms(requests, params)
        tokens = [[] for _ in requests]
        logprobs = [[] for _ in requests]
        finished: dict[int, tuple[str, str | None]] = {}
        active = list(range(len(requests)))  # request index of each batch row
        for step in range(params.max_new_tokens):
            uniforms_A = None
            if uniforms_BT is not None:
                uniforms_A = uniforms_BT[active, step].to(logits_BV.device)
            token_A, logprob_A = pick_tokens(logits_BV, params, uniforms_A)
            keep = []
            for row, (i, token, logprob) in enumerate(
                zip(active, token_A.tolist(), logprob_A.tolist(), strict=True)
            ):
                tokens[i].append(token)
                logprobs[i].append(logprob)
                reason = self._finish_reason(
                    tokens[i], params, last_step=step == params.max_new_tokens - 1
                )
                if reason is None:
                    keep.append(row)
                else:
                    finished[i] = reason
            if not keep:
                break
            if len(keep) < len(active):
                keep_t = torch.tensor(keep, device=mask_BL.device)
                cache.batch_select_indices(keep_t)
                mask_BL, next_position_B, token_A = (
                    mask_BL[keep_t],
                    next_position_B[keep_t],
                    token_A[keep_t],
                )
                active = [active[row] for row in keep]
            mask_BL = torch.cat([mask_BL, mask_BL.new_ones(len(active), 1)], dim=1)
            logits_BV = self._forward(token_A[:, None], mask_BL, next_position_B[:, None], cache)
            next_position_B = next_position_B + 1
        return [
            Completion(
                sample_id=r.sample_id,
                prompt_ids=list(r.prompt_ids),
                token_ids=tokens[i],
                logprobs=logprobs[i],
                finish_reason=finished[i][0],
                text=self.tokenizer.decode(tokens[i], skip_special_tokens=True),
                policy_version=self.policy_version,
                stop=finished[i][1],
            )
            for i, r in enumerate(requests)
        ]

    def _prefill(
        self,
        requests: Sequence[GenerationRequest],
        input_ids_BL: Tensor,
        mask_BL: Tensor,
        cache: DynamicCache,
    ) -> tuple[Tensor, Tensor]:
        """Last-position logits of the left-padded prompts, and each row's next position.

        A prompt that several rows share (a GRPO group's samples) runs through the model
        once: its row of the cache and logits is then copied to each of them. The rows get
        the same values as if each had run (one row's result does not depend on the
        others'), up to float round-off. grpo_tiny: 16 forwards instead of 128 rows.

        Subclasses override it to put media into the prompt (their models may place tokens
        at other than consecutive positions, e.g. multimodal rotary positions).
        """
        positions_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        shared = self._shared_rows(requests, input_ids_BL.device)
        if shared is None:
            logits_BV = self._forward(input_ids_BL, mask_BL, positions_BL, cache)
            return logits_BV, positions_BL[:, -1] + 1
        firsts_U, index_B = shared
        logits_UV = self._forward(
            input_ids_BL[firsts_U], mask_BL[firsts_U], positions_BL[firsts_U], cache
        )
        cache.batch_select_indices(index_B)  # each row gets its prompt's keys and values
        return logits_UV[index_B], positions_BL[:, -1] + 1

    def _prefill_key(self, request: GenerationRequest) -> Hashable:
        """Requests with equal keys have equal prefills: here, equal prompts."""
        return tuple(request.prompt_ids)

    def _shared_rows(
        self, requests: Sequence[GenerationRequest], device: torch.device
    ) -> tuple[Tensor, Tensor] | None:
        """(the first row of each distinct prefill, each row's index among them), or None
        when no two rows share one."""
        firsts, index_of_row = distinct_rows([self._prefill_key(r) for r in requests])
        if len(firsts) == len(requests):
            return None
        return torch.tensor(firsts, device=device), torch.tensor(index_of_row, device=device)

    def _forward(
        self, input_ids: Tensor, mask: Tensor, positions: Tensor, cache: DynamicCache
    ) -> Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=self._attention_mask(mask, input_ids.shape[1]),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def _attention_mask(self, mask_BK: Tensor, query_len: int) -> Tensor:
        """What the model attends with: the padding mask ``[B, K]`` of the cached and new
        tokens, or, for a model whose masks are plain causal ones under SDPA, the 4D boolean
        mask transformers would build from it. transformers builds it by vmapping its mask
        functions, ~4 ms a call on a CPU: more than half of a small model's decode step.
        Without padding transformers builds no mask at all, so it gets the padding mask."""
        if not self.builds_own_masks or bool(mask_BK.all()):
            return mask_BK
        return padded_causal_mask(mask_BK, query_len)

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """Token ids ``[B, L]`` with the prompts right-aligned after ``pad_id``s, and the
        mask of the prompts' tokens (one masked store, not a copy per row)."""
        lengths_B = np.array([len(p) for p in prompts], dtype=np.int64)
        length = int(lengths_B.max())
        filled_BL = np.arange(length)[None, :] >= (length - lengths_B)[:, None]
        ids_BL = np.full(filled_BL.shape, self.pad_id, dtype=np.int64)
        ids_BL[filled_BL] = np.fromiter(
            itertools.chain.from_iterable(prompts), dtype=np.int64, count=int(lengths_B.sum())
        )
        mask_BL = torch.from_numpy(filled_BL.astype(np.int64))
        return torch.from_numpy(ids_BL).to(self.device), mask_BL.to(self.device)

    def _finish_reason(
        self, token_ids: list[int], params: SamplingParams, last_step: bool
    ) -> tuple[str, str | None] | None:
        if token_ids[-1] in self.stop_token_ids:
            return "stop", None
        if params.stop:
            # Only a tail can hold a stop string that the newest token completed.
            window = 2 * max(len(s) for s in params.stop) + 4
            tail = self.tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
            for stop in params.stop:
                if stop in tail:
                    return "stop", stop
        return ("length", None) if last_step else None


def distinct_rows(keys: Sequence[Hashable]) -> tuple[list[int], list[int]]:
    """The row of each distinct key's first occurrence, and each row's index among them."""
    first_of: dict[Hashable, int] = {}
    firsts: list[int] = []
    index_of_row: list[int] = []
    for row, key in enumerate(keys):
        if key not in first_of:
            first_of[key] = len(firsts)
            firsts.append(row)
        index_of_row.append(first_of[key])
    return firsts, index_of_row


# Model types whose every layer attends causally over the whole sequence (no sliding window,
# chunks or bidirectional spans), so their SDPA mask is causal AND padding, nothing else.
PLAIN_CAUSAL_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def has_plain_causal_sdpa_masks(config) -> bool:
    """Whether ``padded_causal_mask`` is exactly the mask the model would build: a plain
    causal model type under SDPA, with no sliding-window layer configured."""
    layer_types = getattr(config, "layer_types", None) or ()
    return (
        config.model_type in PLAIN_CAUSAL_MODEL_TYPES
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and getattr(config, "sliding_window", None) is None
        and all(kind == "full_attention" for kind in layer_types)
    )


def padded_causal_mask(mask_BK: Tensor, query_len: int) -> Tensor:
    """``[B, 1, Q, K]`` booleans, True where query ``q`` (the last ``Q`` of the ``K``
    positions) may attend key ``k``: ``k`` is at or before ``q`` and not padding."""
    key_len = mask_BK.shape[1]
    keys_K = torch.arange(key_len, device=mask_BK.device)
    causal_QK = keys_K[None, :] <= keys_K[key_len - query_len :, None]
    return causal_QK[None, None] & mask_BK.bool()[:, None, None, :]


def _uniforms(requests: Sequence[GenerationRequest], params: SamplingParams) -> Tensor:
    """Each request's uniforms for its tokens 0 .. max_new_tokens - 1, one row per request,
    from its own generator. Drawn up front, in one call per request: a CPU generator draws
    float64 uniforms one after another, so row i holds exactly the numbers that one draw
    per generated token would give (``test_uniforms_drawn_up_front_are_the_per_token_draws``)."""
    rows = [
        torch.rand(
            params.max_new_tokens,
            generator=torch.Generator().manual_seed(sample_seed(params.seed, r.sample_id)),
            dtype=torch.float64,
        )
        for r in requests
    ]
    return torch.stack(rows)


def pick_tokens(
    logits_BV: Tensor, params: SamplingParams, uniforms_B: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Next token per row and its log-prob (module convention); ``uniforms_B`` in [0, 1)."""
    if params.greedy:
        token_B = logits_BV.argmax(dim=-1)
        return token_B, _gather(F.log_softmax(logits_BV, dim=-1), token_B)
    assert uniforms_B is not None
    scaled_BV = logits_BV / params.temperature
    truncated_BV = top_k_top_p_filter(scaled_BV, params.top_k, params.top_p)
    token_B = inverse_cdf_sample(truncated_BV, uniforms_B)
    return token_B, _gather(F.log_softmax(scaled_BV, dim=-1), token_B)


def top_k_top_p_filter(logits_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    """Logits outside the top-k, or outside the smallest top-p mass, set to -inf."""
    if top_k != -1 and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV.double(), dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_sorted_BV = mass_before_BV >= top_p  # the first token always stays
        drop_BV = drop_sorted_BV.scatter(-1, order_BV, drop_sorted_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    return logits_BV


def inverse_cdf_sample(logits_BV: Tensor, uniforms_B: Tensor) -> Tensor:
    """The token whose CDF interval holds ``u``; float64, so zero-mass tokens are never hit."""
    cdf_BV = torch.softmax(logits_BV.double(), dim=-1).cumsum(dim=-1)
    targets_B1 = (uniforms_B.double() * cdf_BV[:, -1]).unsqueeze(-1)
    token_B = torch.searchsorted(cdf_BV, targets_B1, right=True).squeeze(-1)
    return token_B.clamp(max=logits_BV.shape[-1] - 1)


def _gather(logprobs_BV: Tensor, token_B: Tensor) -> Tensor:
    return logprobs_BV.gather(-1, token_B.unsqueeze(-1)).squeeze(-1)


def _unique_storages(module: torch.nn.Module) -> list[torch.UntypedStorage]:
    """The storages behind ``module``'s parameters and buffers, each once (tied weights)."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found.setdefault(storage.data_ptr(), storage)
    return list(found.values())


def _own_storages(module: torch.nn.Module) -> None:
    """Move tensors whose storage cannot be resized (memory-mapped from a safetensors file
    when a CPU model is loaded from a folder) into memory of their own, so that
    ``release_memory`` can empty it; tensors sharing a storage (tied weights) keep sharing."""
    copies: dict[int, torch.UntypedStorage] = {}
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            if storage.resizable() or not storage.nbytes():
                continue
            key = storage.data_ptr()
            if key not in copies:  # once per storage: a folder's tensors may share one file map
                copies[key] = storage.clone()
            own = copies[key]
            tensor.set_(own, tensor.storage_offset(), tensor.size(), tensor.stride())


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)
