"""Load a local Hugging Face folder, including one written by a newer transformers release.

transformers 5 writes folders that the installed 4.x reads wrongly or not at all:

- ``tokenizer_config.json`` names ``"tokenizer_class": "TokenizersBackend"`` (v5's generic
  fast tokenizer), which 4.x does not know; v5 also drops ``added_tokens_decoder`` and
  ``special_tokens_map.json`` and writes ``extra_special_tokens`` as a list. Where the
  class is unknown, the tokenizer is built from the folder's ``tokenizer.json`` with the
  special tokens, chat template (``chat_template.jinja``) and settings of the config.
- ``config.json`` keeps RoPE in ``rope_parameters`` (``{"rope_type", "rope_theta", ...}``)
  instead of ``rope_theta``/``rope_scaling``. 4.x would silently use its default
  ``rope_theta`` (10000 instead of Qwen3's 1000000): the values are moved back.

Anything that still cannot load raises ``ConfigError`` naming the folder and the reason: a
restart cannot fix it.

Must not: download anything (``local_files_only=True`` everywhere).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.config.errors import ConfigError

log = logging.getLogger(__name__)
# Settings of tokenizer_config.json that PreTrainedTokenizerFast takes as they are.
_TOKENIZER_SETTINGS = (
    "model_max_length",
    "padding_side",
    "truncation_side",
    "clean_up_tokenization_spaces",
    "model_input_names",
)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def load_tokenizer(folder: str | Path, field: str = "model.tokenizer") -> PreTrainedTokenizerBase:
    """The folder's tokenizer; ``ConfigError`` on ``field`` when it cannot be loaded."""
    folder = Path(folder).expanduser()
    settings = _read_json(folder / "tokenizer_config.json", field)
    class_name = settings.get("tokenizer_class")
    try:
        if class_name and not _known_tokenizer_class(class_name):
            return tokenizer_from_json(folder, settings, field)
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except ConfigError:
        raise
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, TypeError...
        raise ConfigError(
            field,
            f"{folder} has no tokenizer transformers {transformers.__version__} can load "
            f"({type(err).__name__}: {_first_line(err)}); point {field} at a folder with "
            "tokenizer.json and tokenizer_config.json",
        ) from None


def tokenizer_from_json(
    folder: Path, settings: dict[str, Any], field: str = "model.tokenizer"
) -> PreTrainedTokenizerFast:
    """A fast tokenizer from ``tokenizer.json`` plus what ``tokenizer_config.json`` says."""
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(
            field,
            f"{folder}: tokenizer class {settings.get('tokenizer_class')!r} is unknown to "
            f"transformers {transformers.__version__} and there is no tokenizer.json to fall "
            "back to; save the tokenizer with tokenizer.json (any fast tokenizer has one)",
        )
    log.warning(
        "model: %s names tokenizer class %r, unknown to transformers %s; building it from "
        "tokenizer.json",
        folder,
        settings.get("tokenizer_class"),
        transformers.__version__,
    )
    kwargs = {key: settings[key] for key in _TOKENIZER_SETTINGS if key in settings}
    kwargs.update({key: _token_text(settings[key]) for key in _SPECIAL_TOKENS if settings.get(key)})
    extra = settings.get("extra_special_tokens") or settings.get("additional_special_tokens")
    if isinstance(extra, list):  # v5 writes a list; 4.x calls these additional_special_tokens
        kwargs["additional_special_tokens"] = [_token_text(token) for token in extra]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **kwargs)
    template = folder / "chat_template.jinja"
    tokenizer.chat_template = (
        template.read_text(encoding="utf-8")
        if template.is_file()
        else settings.get("chat_template")
    )
    return tokenizer


def load_model_config(folder: str | Path, field: str = "model.path") -> PretrainedConfig:
    """The folder's ``config.json`` as the installed transformers needs it."""
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # OSError (no file), ValueError/KeyError (unknown model type)
        raise ConfigError(
            field,
            f"{folder} has no config.json transformers {transformers.__version__} can read "
            f"({type(err).__name__}: {_first_line(err)}); point {field} at a Hugging Face "
            "model folder",
        ) from None
    adapt_rope_parameters(config)
    return config


def adapt_rope_parameters(config: PretrainedConfig) -> None:
    """Move transformers 5's ``rope_parameters`` back into ``rope_theta``/``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        return
    config.rope_theta = params["rope_theta"]
    rope_type = params.get("rope_type", "default")
    config.rope_scaling = (
        None if rope_type == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    )


def _known_tokenizer_class(name: str) -> bool:
    return any(hasattr(transformers, candidate) for candidate in (name, f"{name}Fast"))


def _token_text(token: Any) -> str:
    """A special token as written: a string, or an AddedToken dict with ``content``."""
    return token["content"] if isinstance(token, dict) else str(token)


def _read_json(path: Path, field: str) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(
            field, f"{path} is not readable JSON ({err}); fix or replace it"
        ) from None


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"
