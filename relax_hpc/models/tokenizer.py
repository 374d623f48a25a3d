"""The built-in offline character tokenizer (``model.tokenizer: char``).

One token per printable ASCII character (plus newline and tab), and four special tokens.
It is a real ``transformers.PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel model,
so ``save_pretrained`` writes a folder that ``AutoTokenizer.from_pretrained`` loads back
(an HF export of a tiny model is a normal HF folder). Encoding prepends ``<bos>``; decoding
concatenates characters; characters outside the alphabet become ``<unk>``.

Must not: download anything, or depend on a vocabulary file that is not built here.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0..3, in this order
# Printable ASCII without the vertical whitespace that string.printable also carries.
ALPHABET = "".join(c for c in string.printable if c not in "\r\x0b\x0c")

# A minimal chat template so that datasets with ``apply_chat_template: true`` work too:
# ``role: content`` lines. Tool calls and tool results follow Qwen3's template in this
# format: an assistant's ``tool_calls`` are written as ``<tool_call>`` JSON blocks, and
# consecutive ``tool`` messages become one user turn of ``<tool_response>`` blocks.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}user:{% endif -%}"
    "{{ '\n<tool_response>\n' ~ message['content'] ~ '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '\n' }}{% endif -%}"
    "{%- else -%}"
    "{{ message['role'] ~ ': ' ~ (message['content'] or '') }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- if not loop.first or message['content'] %}{{ '\n' }}{% endif -%}"
    "{%- set call = call.function or call -%}"
    "{%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson -%}"
    "{{ '<tool_call>\n{\"name\": \"' ~ call.name ~ '\", \"arguments\": ' ~ arguments ~ '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ 'assistant: ' }}{% endif -%}"
)


def char_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first, then the alphabet in ``string.printable`` order."""
    tokens = [*SPECIAL_TOKENS, *ALPHABET]
    return {token: index for index, token in enumerate(tokens)}


def build_char_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """The character tokenizer; identical on every machine, no files needed."""
    vocab = char_vocab()
    post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    backend = char_level_backend(vocab, SPECIAL_TOKENS, UNK_TOKEN, post_processor)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        # Causal LMs take no token types; without this, model.generate(**tokenizer(...)) fails.
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def char_level_backend(
    vocab: dict[str, int],
    special_tokens: Sequence[str],
    unk_token: str,
    post_processor: processors.PostProcessor | None = None,
) -> Tokenizer:
    """A ``tokenizers`` WordLevel model over single characters plus ``special_tokens``."""
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
    # Every character is its own pre-token; special tokens are matched before this runs.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    if post_processor is not None:
        backend.post_processor = post_processor
    backend.add_special_tokens(list(special_tokens))
    return backend
