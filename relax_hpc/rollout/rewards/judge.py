"""The judge as a scorer: a frozen generative model whose verdict is the reward.

``JudgeScorer`` renders each sample with the judge template, lets the judge's engine answer
greedily (any ``rollout.engines`` engine: transformers on CPU or one GPU, SGLang on GPUs),
and parses the answer with the verdict parser. The same object serves the judge on the
rollout's engines (called by the rollout) and the judge in its own component (called by
``relax_hpc.judge.server``). Its engine is never given to a weight receiver: the judge's
weights are frozen.

Nothing is lost silently: a row the template cannot fill, a judge prompt longer than the
judge's context, an engine that raises, and an answer without a verdict each score 0 as
*failed* with the reason.

Must not: build models (the engine and tokenizer are passed in), or know where it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from relax_hpc.rollout.engines.base import Engine, GenerationRequest, SamplingParams
from relax_hpc.rollout.rewards.result import RewardResult, failed
from relax_hpc.rollout.rewards.scorer import as_score_item
from relax_hpc.rollout.rewards.verdicts import TemplateError, Verdict, render

log = logging.getLogger(__name__)
ANSWER_DETAIL_CHARS = 200  # of the judge's answer kept in a sample's reward details


class JudgeScorer:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        template: str,
        verdict: Verdict,
        max_new_tokens: int = 16,
        batch_size: int = 64,
        apply_chat_template: bool = False,
        max_prompt_tokens: int | None = None,
    ) -> None:
        """``template`` is the text (``verdicts.template_text``); ``max_prompt_tokens``
        bounds a judge prompt (the judge's context less ``max_new_tokens``)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.verdict = verdict
        self.params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
        self.batch_size = batch_size
        self.apply_chat_template = apply_chat_template
        self.max_prompt_tokens = max_prompt_tokens
        self.num_calls = 0

    def score(self, items: Sequence[Any]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(items)
        prompts: list[tuple[int, list[int]]] = []
        for index, item in enumerate(map(as_score_item, items)):
            prompt_ids = self._prompt_ids(item)
            if isinstance(prompt_ids, RewardResult):
                results[index] = prompt_ids
            else:
                prompts.append((index, prompt_ids))
        # Greedy verdicts depend on the judge prompt alone: identical ones (a group's
        # samples often agree) are judged once.
        first_of: dict[tuple[int, ...], int] = {}
        unique = [(i, ids) for i, ids in prompts if first_of.setdefault(tuple(ids), i) == i]
        for start in range(0, len(unique), self.batch_size):
            chunk = unique[start : start + self.batch_size]
            for (index, _), result in zip(chunk, self._judge(chunk), strict=True):
                results[index] = result
        for index, ids in prompts:
            results[index] = results[first_of[tuple(ids)]]
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            shutdown()

    def _prompt_ids(self, item) -> list[int] | RewardResult:
        try:
            text = render(self.template, item.prompt, item.completion, item.answer, item.metadata)
        except TemplateError as err:
            return failed(str(err))
        if self.apply_chat_template:
            messages = [{"role": "user", "content": text}]
            # enable_thinking: Qwen3's template reads it (a judge answers directly); others
            # ignore unknown variables.
            ids = self.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, enable_thinking=False
            )
        else:
            ids = self.tokenizer(text)["input_ids"]
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            return failed(
                f"the judge prompt has {len(ids)} tokens, more than the judge's context allows "
                f"({self.max_prompt_tokens}); shorten judge.template or rollout.max_new_tokens"
            )
        return list(ids)

    def _judge(self, chunk: list[tuple[int, list[int]]]) -> list[RewardResult]:
        self.num_calls += 1
        requests = [GenerationRequest(f"judge/{self.num_calls}/{i}", ids) for i, ids in chunk]
        try:
            completions = self.engine.generate(requests, self.params)
        except Exception as err:  # a judge that fails fails its samples, not the rollout
            log.warning("judge: the engine raised %s: %s", type(err).__name__, err)
            reason = f"the judge's engine raised {type(err).__name__}: {err}"
            return [failed(reason) for _ in chunk]
        results = []
        for completion in completions:
            result = self.verdict(completion.text)
            details = {**result.details, "judge_answer": completion.text[:ANSWER_DETAIL_CHARS]}
            results.append(RewardResult(result.score, details, result.failed))
        return results
