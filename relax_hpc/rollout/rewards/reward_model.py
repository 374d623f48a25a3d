"""A sequence-classification reward model (a score head) from a local Hugging Face folder.

The model reads ``template`` filled with the prompt, the response, the reference and the
row's columns; the reward is logit ``label`` of the last token (transformers'
``*ForSequenceClassification`` pools the last non-pad token), raw or squashed by a sigmoid
(``normalize``). Texts longer than ``max_length`` tokens lose their beginning (the
response is at the end). Batches of ``batch_size`` run on the rollout's device; the model
is frozen (eval mode, no gradients, never synced).

A row the template cannot fill, and a batch the model fails on, score 0 as *failed* with the
reason.

Must not: download anything (``local_files_only``), or know about the rollout loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from relax_hpc.config import ConfigError
from relax_hpc.models.hf_folder import load_model_config, load_tokenizer
from relax_hpc.rollout.rewards.result import RewardResult, failed
from relax_hpc.rollout.rewards.scorer import as_score_item
from relax_hpc.rollout.rewards.verdicts import TemplateError, render

log = logging.getLogger(__name__)


class RewardModelScorer:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        template: str = "{prompt}{response}",
        label: int = 0,
        normalize: str = "none",
        batch_size: int = 16,
        max_length: int = 2048,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.tokenizer.truncation_side = "left"  # keep the response, which comes last
        self.template = template
        self.label = label
        self.normalize = normalize
        self.batch_size = batch_size
        self.max_length = max_length

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def score(self, items: Sequence[Any]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(items)
        texts: list[tuple[int, str]] = []
        for index, item in enumerate(map(as_score_item, items)):
            try:
                texts.append(
                    (
                        index,
                        render(
                            self.template, item.prompt, item.completion, item.answer, item.metadata
                        ),
                    )
                )
            except TemplateError as err:
                results[index] = failed(str(err).replace("judge template", "reward model template"))
        for start in range(0, len(texts), self.batch_size):
            chunk = texts[start : start + self.batch_size]
            for (index, _), result in zip(chunk, self._score_texts(chunk), strict=True):
                results[index] = result
        return results  # type: ignore[return-value]

    def close(self) -> None:
        return None

    @torch.no_grad()
    def _score_texts(self, chunk: list[tuple[int, str]]) -> list[RewardResult]:
        try:
            batch = self.tokenizer(
                [text for _, text in chunk],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(**batch).logits[:, self.label].float()
        except Exception as err:  # a failing model fails its samples, not the rollout
            log.warning("reward model: %s: %s", type(err).__name__, err)
            return [failed(f"the reward model raised {type(err).__name__}: {err}") for _ in chunk]
        scores = torch.sigmoid(logits) if self.normalize == "sigmoid" else logits
        return [
            RewardResult(float(score), {"logit": float(logit)})
            for score, logit in zip(scores.tolist(), logits.tolist(), strict=True)
        ]


def load_reward_model(
    path: str, field: str, label: int, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, Any]:
    """Model and tokenizer of a local folder; ``ConfigError`` naming ``field`` if unusable."""
    config = load_model_config(path, field)
    if getattr(config, "num_labels", 0) <= label:
        raise ConfigError(
            field,
            f"{path} has {config.num_labels} output(s); its score head has no logit {label} "
            "(set the reward model's label)",
        )
    tokenizer = load_tokenizer(path, field)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id  # the head pools the last non-pad token
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, local_files_only=True, dtype=dtype
        )
    except Exception as err:  # missing/truncated weights, or not a classification model
        first = (str(err).strip().splitlines() or ["no message"])[0]
        raise ConfigError(
            field,
            f"{path} does not load as a sequence-classification model with transformers "
            f"{transformers.__version__} ({type(err).__name__}: {first})",
        ) from None
    return model, tokenizer
