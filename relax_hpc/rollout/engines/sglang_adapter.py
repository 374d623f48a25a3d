"""Translation between our engine types and SGLang's offline-engine API, without SGLang.

Owns: building the keyword arguments of ``sglang.Engine.generate`` from our requests and
``SamplingParams``, parsing its result dicts into ``Completion`` objects, turning a
weight-sync manifest into the ``names/dtypes/shapes`` lists of
``update_weights_from_distributed``, and reading SGLang's success results. Pure functions:
no sglang import, no GPU, so all of it is unit-tested on CPU against stored fixtures.

The contract was read from SGLang's source, not recorded on a GPU (pin: sglang 0.5.6.post2,
inside our ``sglang>=0.5.5,<0.6`` extra; files ``srt/entrypoints/engine.py``,
``srt/managers/io_struct.py``, ``srt/managers/tokenizer_manager.py``,
``srt/managers/schedule_batch.py``, ``srt/sampling/sampling_params.py``):

- a batch call (``input_ids`` is a list of lists) returns one dict per prompt, in prompt
  order: ``{"text": str, "output_ids": [...], "meta_info": {...}}``;
- ``meta_info["id"]`` is the request's ``rid``; ``meta_info["finish_reason"]`` is
  ``{"type": "stop", "matched": <token id (EOS) | stop string>}``,
  ``{"type": "length", "length": N}`` or ``{"type": "abort", "message": ...}``;
- with ``return_logprob=True``, ``meta_info["output_token_logprobs"]`` holds one
  ``(logprob, token_id, text_or_None)`` per generated token (EOS included) and
  ``meta_info["completion_tokens"]`` counts the generated tokens;
- the sampler's log-prob is ``log(softmax(logits / T))`` before top-k/top-p, and greedy
  (``temperature=0`` becomes ``top_k=1, temperature=1``) reports ``log_softmax(logits)``:
  exactly the convention of ``engines/base.py``, unless ``SGLANG_RETURN_ORIGINAL_LOGPROB``
  is set (then it is always temperature 1), which ``check_logprob_environment`` refuses.

Must not: import sglang or torch, or talk to a running engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from relax_hpc.rollout.engines.base import (
    Completion,
    GenerationRequest,
    SamplingParams,
    sample_seed,
)

SGLANG_API_VERSION = "0.5.6.post2"  # the source these shapes were read from
MULTIMODAL_ARGS = {"image": "image_data", "audio": "audio_data"}  # request key -> generate arg
_TRUTHY = {"1", "true", "yes", "on"}

SEED_MASK = 0x7FFF_FFFF  # sampling_seed must fit SGLang's int32 seed tensor
# Added to a media placeholder token's logit (sampling_params.logit_bias, applied by SGLang
# before sampling and log-probs): the value of media.inputs.MASKED_LOGIT, so the policy is
# the same distribution over the vocabulary without media tokens on every engine.
MEDIA_TOKEN_BIAS = -1.0e9


class SGLangResponseError(ValueError):
    """SGLang answered with something we cannot turn into a trustworthy ``Completion``."""


class SGLangAborted(RuntimeError):
    """SGLang aborted a request (drain, pause in abort mode, or an engine-side error)."""


class SGLangCallFailed(RuntimeError):
    """A control call (weight update, memory, cache) reported failure."""


# --- requests -----------------------------------------------------------------------------------
def media_logit_bias(media_token_ids: Iterable[int]) -> dict[str, float]:
    """SGLang's ``logit_bias`` (token id as a string -> bias) masking media tokens."""
    return {str(int(token)): MEDIA_TOKEN_BIAS for token in media_token_ids}


def sampling_params_for(
    params: SamplingParams,
    request: GenerationRequest,
    seeded: bool,
    logit_bias: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """SGLang ``sampling_params`` of one request.

    ``no_stop_trim`` keeps the stop string in ``text``, so the text is the decoded tokens
    like the transformers engine's; ``sampling_seed`` is sent only when ``seeded`` (the
    installed SGLang has the field); ``logit_bias`` masks a media model's placeholder
    tokens (``media_logit_bias``).
    """
    sglang_params: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "no_stop_trim": True,
        "skip_special_tokens": True,
    }
    if params.greedy:
        sglang_params.update(temperature=0.0, top_p=1.0, top_k=1)
    else:
        sglang_params.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.stop:
        sglang_params["stop"] = list(params.stop)
    if seeded:
        # SGLang packs seeds into an int32 tensor in deterministic mode: keep 31 bits.
        sglang_params["sampling_seed"] = sample_seed(params.seed, request.sample_id) & SEED_MASK
    if logit_bias:
        sglang_params["logit_bias"] = dict(logit_bias)
    return sglang_params


def generate_kwargs(
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    rids: Sequence[str],
    seeded: bool,
    logit_bias: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of one batched ``sglang.Engine.generate`` call."""
    if not requests:
        raise ValueError("generate needs at least one request")
    if any(not r.prompt_ids for r in requests):
        raise ValueError("every request needs at least one prompt token")
    kwargs: dict[str, Any] = {
        "input_ids": [list(r.prompt_ids) for r in requests],
        "sampling_params": [sampling_params_for(params, r, seeded, logit_bias) for r in requests],
        "return_logprob": True,
        "rid": list(rids),
    }
    kwargs.update(multimodal_kwargs(requests))
    return kwargs


def multimodal_kwargs(requests: Sequence[GenerationRequest]) -> dict[str, list]:
    """``image_data``/``audio_data`` lists aligned with the batch (None where a request has none).

    Passed through untouched: SGLang's processor accepts paths, URLs, base64 strings,
    PIL images, or preprocessed dicts (a media model's engine sends one
    ``processor_output`` dict per request: ``sglang_media``). Omitted entirely for a
    text-only batch.
    """
    for request in requests:
        unknown = set(request.multimodal or {}) - set(MULTIMODAL_ARGS)
        if unknown:
            raise ValueError(
                f"request {request.sample_id}: multimodal keys {sorted(unknown)} are not "
                f"supported by the SGLang engine (use {sorted(MULTIMODAL_ARGS)})"
            )
    kwargs = {}
    for key, arg in MULTIMODAL_ARGS.items():
        column = [(r.multimodal or {}).get(key) for r in requests]
        if any(item is not None for item in column):
            # A list per request: SGLang wraps every entry itself when the first one is not
            # a list, which breaks a batch that mixes single items and lists.
            kwargs[arg] = [x if x is None or isinstance(x, list) else [x] for x in column]
    return kwargs


def request_ids(requests: Sequence[GenerationRequest], call_index: int) -> list[str]:
    """Unique SGLang ``rid`` per in-flight request: sample ids repeat across evaluations."""
    return [f"{r.sample_id}@{call_index}" for r in requests]


# --- responses ----------------------------------------------------------------------------------
def parse_completions(
    outputs: Sequence[Mapping[str, Any]] | Mapping[str, Any],
    requests: Sequence[GenerationRequest],
    rids: Sequence[str],
    params: SamplingParams,
    policy_version: int,
) -> list[Completion]:
    """One ``Completion`` per request, in request order (checked against ``meta_info.id``)."""
    if isinstance(outputs, Mapping):
        outputs = [outputs]  # a single-prompt call answers with one dict
    if len(outputs) != len(requests):
        raise SGLangResponseError(
            f"SGLang returned {len(outputs)} results for {len(requests)} requests"
        )
    return [
        parse_completion(output, request, rid, params, policy_version)
        for output, request, rid in zip(outputs, requests, rids, strict=True)
    ]


def parse_completion(
    output: Mapping[str, Any],
    request: GenerationRequest,
    rid: str,
    params: SamplingParams,
    policy_version: int,
) -> Completion:
    meta = output.get("meta_info")
    if not isinstance(meta, Mapping):
        raise SGLangResponseError(f"request {request.sample_id}: result has no meta_info")
    if meta.get("id", rid) != rid:
        raise SGLangResponseError(
            f"request {request.sample_id}: result for rid {meta.get('id')!r} arrived in the "
            f"place of {rid!r}; batch order was not preserved"
        )
    finish_reason, stop = parse_finish_reason(meta.get("finish_reason"), request, params)
    token_ids, logprobs = parse_output_logprobs(meta, request)
    return Completion(
        sample_id=request.sample_id,
        prompt_ids=list(request.prompt_ids),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish_reason,
        text=output.get("text") or "",
        policy_version=policy_version,
        stop=stop,
    )


def parse_output_logprobs(
    meta: Mapping[str, Any], request: GenerationRequest
) -> tuple[list[int], list[float]]:
    """Sampled token ids and their log-probs from ``output_token_logprobs``.

    The token ids are taken from the same tuples as the log-probs, so the two lists are
    aligned by construction; ``completion_tokens`` guards against a truncated list.
    """
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SGLangResponseError(
            f"request {request.sample_id}: SGLang returned no output_token_logprobs "
            "(generate must be called with return_logprob=True); the trainer needs the "
            "rollout log-prob of every token"
        )
    token_ids: list[int] = []
    logprobs: list[float] = []
    for position, entry in enumerate(entries):
        logprob, token_id = entry[0], entry[1]
        if logprob is None:
            raise SGLangResponseError(
                f"request {request.sample_id}: no log-prob for generated token {position}"
            )
        token_ids.append(int(token_id))
        logprobs.append(float(logprob))
    expected = meta.get("completion_tokens", len(entries))
    if expected != len(entries):
        raise SGLangResponseError(
            f"request {request.sample_id}: {len(entries)} log-probs for {expected} generated tokens"
        )
    if not token_ids:
        raise SGLangResponseError(f"request {request.sample_id}: SGLang generated no token")
    return token_ids, logprobs


def parse_finish_reason(
    reason: Any, request: GenerationRequest, params: SamplingParams
) -> tuple[str, str | None]:
    """(``"stop"`` | ``"length"``, the stop string that ended it or None)."""
    if not isinstance(reason, Mapping):
        raise SGLangResponseError(
            f"request {request.sample_id}: unfinished or malformed finish_reason {reason!r}"
        )
    kind = reason.get("type")
    if kind == "length":
        return "length", None
    if kind == "stop":
        matched = reason.get("matched")
        # an int is a stop token (EOS); a str is one of our stop strings, or SGLang's own
        # "NaN happened" (it also replaced the last token by EOS): that sample is garbage
        if isinstance(matched, str) and matched not in params.stop:
            raise SGLangResponseError(
                f"request {request.sample_id}: SGLang stopped on {matched!r}, not on a stop "
                "string of ours (NaN in the logits?)"
            )
        return "stop", matched if isinstance(matched, str) else None
    if kind == "abort":
        raise SGLangAborted(
            f"request {request.sample_id} was aborted by SGLang: {reason.get('message')}"
        )
    raise SGLangResponseError(f"request {request.sample_id}: unknown finish_reason {reason!r}")


# --- control calls ------------------------------------------------------------------------------
def require_success(result: Any, action: str) -> str:
    """The message of a successful SGLang control result; raises ``SGLangCallFailed``.

    The 0.5 line answers with ``(success, message)`` or ``(success, message,
    num_paused_requests)`` tuples, some newer calls with an object or dict carrying
    ``success``/``message``, and memory calls with None (no failure channel).
    """
    if result is None:
        return ""
    if isinstance(result, tuple | list):
        success, message = bool(result[0]), str(result[1]) if len(result) > 1 else ""
    elif isinstance(result, Mapping):
        success, message = bool(result.get("success", True)), str(result.get("message", ""))
    else:
        success = bool(getattr(result, "success", True))
        message = str(getattr(result, "message", ""))
    if not success:
        raise SGLangCallFailed(f"SGLang {action} failed: {message}")
    return message


def chunks_by_bytes(items: Sequence[Any], size_of: Callable[[Any], int], limit: int) -> list[list]:
    """Consecutive groups of ``items`` of at most ``limit`` bytes (a larger item alone).

    SGLang materialises every tensor of one update call on each GPU before it loads any
    (full, unsharded tensors), so a whole model in one call can run out of the memory the
    KV cache left; updates go in chunks instead.
    """
    chunks: list[list] = []
    total = 0
    for item in items:
        size = size_of(item)
        if not chunks or total + size > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(item)
        total += size
    return chunks


def distributed_update_args(specs: Iterable[Any]) -> dict[str, list]:
    """``names``/``dtypes``/``shapes`` of ``update_weights_from_distributed``.

    ``specs`` are weight-sync ``TensorSpec``-like objects (``name``, ``dtype`` as a torch
    dtype name such as ``"bfloat16"``, ``shape``), in broadcast order. SGLang resolves the
    dtype with ``getattr(torch, name)``, so our manifest names travel unchanged.
    """
    specs = list(specs)
    if not specs:
        raise ValueError("a distributed weight update needs at least one tensor")
    return {
        "names": [spec.name for spec in specs],
        "dtypes": [spec.dtype for spec in specs],
        "shapes": [list(spec.shape) for spec in specs],
    }


def check_logprob_environment(environ: Mapping[str, str]) -> None:
    """Refuse ``SGLANG_RETURN_ORIGINAL_LOGPROB``: it breaks the log-prob convention."""
    value = environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "")
    if value.strip().lower() in _TRUTHY:
        raise ValueError(
            "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would report temperature-1 "
            "log-probs, but the trainer expects log_softmax(logits / temperature); unset it"
        )
