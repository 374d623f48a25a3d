"""Observations as tokens: what the chat template puts between two assistant turns.

A multi-turn sample is ``prompt + turn_1 + observation_1 + turn_2 + ...``. The model's
tokens are kept exactly as sampled (never decoded and re-tokenized, which could shift token
boundaries under the policy's own log-probs); an observation is text rendered by the
tokenizer's chat template and tokenized on its own:

1. the rest of the assistant turn's *closing*: what the template writes after an assistant
   message's content (Qwen3: ``<|im_end|>\\n``; the char template: ``\\n``). A turn that
   ended with the end-of-turn token already holds its first part, so only the remainder is
   added (Qwen3: ``\\n``); a turn that ended at a stop string (``</tool_call>``) or at its
   token limit gets the whole closing;
2. the observation messages (``tool`` and/or ``user``) rendered alone, with the generation
   prompt: for Qwen3 ``<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n
   <|im_start|>assistant\\n``. Rendering them alone (not the whole conversation) keeps
   templates that rewrite earlier turns (Qwen3 drops old ``<think>`` blocks) from changing
   tokens the model already produced.

Used by the rollout's episode driver (``rollout.multiturn``) and by the warm starts that
write multi-turn demonstrations (``tasks.calculator``, ``tasks.guess``): both put the same
tokens between two turns. Observation content is text, unless the caller renders media
(``media_parts=True``: the episode driver of a vision model, which expands the image pads
with its ``MediaProcessor``); otherwise structured content (an image part) is refused with
a ``ValueError`` naming the fix.

Must not: import torch or the engines; the tokenizer is the only collaborator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

Message = Mapping[str, Any]
_SENTINEL = "\x00relax-hpc-turn-content\x00"


class ChatFormat:
    """Renders prompts and observations with ``tokenizer``'s chat template."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if tokenizer.chat_template is None:
            raise ValueError(
                "multi-turn rollouts render observations with the tokenizer's chat template, "
                "and this tokenizer has none; use a tokenizer with a chat template"
            )
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})  # e.g. {"enable_thinking": False}
        self.turn_closing = self._assistant_closing()

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] = (),
        add_generation_prompt: bool = True,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_end|>``) are parsed."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[int]:
        """A whole prompt (an environment's first observation), ending in the generation prompt."""
        return self.encode(self.render(messages, tools))

    def observation_text(
        self,
        messages: Sequence[Message],
        end_of_turn_text: str | None,
        media_parts: bool = False,
    ) -> str:
        """The text after a model turn; ``end_of_turn_text``: the end token it ended with.
        ``media_parts``: typed content parts are rendered by the template (the caller
        expands their media tokens)."""
        for message in messages:
            if not media_parts and not isinstance(message.get("content", ""), str):
                raise ValueError(
                    f"an observation's {message.get('role')!r} message has non-text content; "
                    "a text model's observations carry text only (images in observations "
                    "need a vision model, model.modality=vision)"
                )
        closing = self.turn_closing
        if end_of_turn_text and closing.startswith(end_of_turn_text):
            closing = closing[len(end_of_turn_text) :]
        return closing + self.render(messages)

    def observation_ids(
        self, messages: Sequence[Message], end_of_turn_text: str | None
    ) -> list[int]:
        return self.encode(self.observation_text(messages, end_of_turn_text))

    def _assistant_closing(self) -> str:
        """What the template writes after an assistant message's content."""
        probes = (
            [{"role": "assistant", "content": _SENTINEL}],
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}],
        )
        for messages in probes:
            try:
                text = self.render(messages, add_generation_prompt=False)
            except Exception:  # noqa: BLE001 - templates may reject a probe; try the next
                continue
            if _SENTINEL in text:
                return text[text.rindex(_SENTINEL) + len(_SENTINEL) :]
        raise ValueError(
            "cannot find how the tokenizer's chat template ends an assistant message "
            "(rendering an assistant message failed); multi-turn rollouts need it"
        )
