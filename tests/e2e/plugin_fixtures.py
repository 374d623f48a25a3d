"""A throwaway engine and a throwaway trainer backend, defined outside the package.

``tests/e2e/test_plugin_run.py`` names them in a run's config as ``module:name``
(``rollout.backend=plugin_fixtures:OneByOneBuilder``,
``trainer.backend=plugin_fixtures:CountingTorchBackend``); nothing in ``relax_hpc`` lists
them. Each logs a line the test looks for in the task logs, so the test fails if the run
quietly used a built-in instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from relax_hpc.config import RunConfig
from relax_hpc.models.build import build_causal_lm, build_tokenizer, resolve_dtype
from relax_hpc.rollout.engines.base import (
    Completion,
    Engine,
    GenerationRequest,
    SamplingParams,
    sample_seed,
)
from relax_hpc.rollout.engines.builder import EngineBuilder, PolicyEngine
from relax_hpc.rollout.engines.transformers_engine import pick_tokens
from relax_hpc.trainer.torch_backend import TorchBackend

log = logging.getLogger(__name__)
ENGINE_LINE = "one-by-one engine: generated"
BACKEND_LINE = "counting backend: published policy weights"


class OneByOneEngine(Engine):
    """One request at a time, one token at a time, no KV cache: slow and plain."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.policy_version = 0

    def generate(
        self, requests: Sequence[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        completions = [self._complete(request, params) for request in requests]
        version = self.policy_version
        log.info("%s %d completions at policy_version %d", ENGINE_LINE, len(requests), version)
        return completions

    @torch.no_grad()
    def _complete(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        generator = torch.Generator().manual_seed(sample_seed(params.seed, request.sample_id))
        tokens: list[int] = []
        logprobs: list[float] = []
        finish, stop = "length", None
        for _ in range(params.max_new_tokens):
            ids_1L = torch.tensor([[*request.prompt_ids, *tokens]])
            logits_1V = self.model(input_ids=ids_1L).logits[:, -1].float()
            uniform_1 = (
                None if params.greedy else torch.rand(1, generator=generator, dtype=torch.float64)
            )
            token_1, logprob_1 = pick_tokens(logits_1V, params, uniform_1)
            tokens.append(int(token_1))
            logprobs.append(float(logprob_1))
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            stop = next((s for s in params.stop if s in text), None)
            if tokens[-1] == self.tokenizer.eos_token_id or stop is not None:
                finish = "stop"
                break
        return Completion(
            sample_id=request.sample_id,
            prompt_ids=list(request.prompt_ids),
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=finish,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            policy_version=self.policy_version,
            stop=stop,
        )

    @torch.no_grad()
    def load_state_dict(
        self,
        named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        policy_version: int,
    ) -> None:
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        targets = self.model.state_dict()
        for name, tensor in items:
            targets[name].copy_(tensor)
        self.policy_version = policy_version


class OneByOneBuilder(EngineBuilder):
    """The whole plug-in: build the engine; weights come through ``load_state_dict``."""

    def build_policy(self, cfg: RunConfig, device: torch.device) -> PolicyEngine:
        tokenizer = build_tokenizer(cfg.model)
        dtype = resolve_dtype(cfg.model.dtype, device)
        model = build_causal_lm(cfg.model, tokenizer, dtype, seed=cfg.seed)
        return OneByOneEngine(model.to(device), tokenizer), tokenizer, None


class CountingTorchBackend(TorchBackend):
    """The torch backend, counting the weights it publishes."""

    published = 0

    def policy_weights(self) -> dict[str, Tensor]:
        self.published += 1
        log.info("%s (%d)", BACKEND_LINE, self.published)
        return super().policy_weights()
