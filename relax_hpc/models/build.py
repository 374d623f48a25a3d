"""Build the tokenizer and the causal LM of a ``ModelConfig``, from local files only.

Two sources: a local Hugging Face folder (``model.path``, read through ``hf_folder``, which
also takes folders written by transformers 5), or a transformers architecture built from
``model.arch`` with the vocabulary size and special-token ids taken from the tokenizer (the
tiny CPU model). Both the trainer and the rollout build their model here, so the two
processes agree on names, shapes and initial weights. A folder that cannot be loaded is a
``ConfigError`` (exit 2, no restart).

Must not: download anything (every ``from_pretrained`` is ``local_files_only=True``), or
know about training, rollout or the run directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import ModelConfig
from relax_hpc.models.hf_folder import load_model_config, load_tokenizer
from relax_hpc.models.tokenizer import CHAR_TOKENIZERS, build_char_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """``model.dtype`` as a torch dtype; ``auto`` is float32 on CPU and bfloat16 on GPU."""
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"model.dtype: unknown dtype {name!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def build_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """``model.tokenizer``: ``char`` / ``char_tools`` (built in), ``auto`` (from
    ``model.path``) or a folder."""
    if model_cfg.tokenizer in CHAR_TOKENIZERS:
        return build_char_tokenizer(tool_tags=CHAR_TOKENIZERS[model_cfg.tokenizer])
    folder = model_cfg.path if model_cfg.tokenizer == "auto" else model_cfg.tokenizer
    if folder is None:
        raise ConfigError(
            "model.tokenizer", "'auto' needs model.path; set model.tokenizer=char or a folder"
        )
    field = "model.path" if model_cfg.tokenizer == "auto" else "model.tokenizer"
    tokenizer = load_tokenizer(folder, field)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs a pad id; it is masked out
    return tokenizer


def build_causal_lm(
    model_cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PreTrainedModel:
    """The policy model in eval mode on CPU; the caller moves it and sets train mode.

    From ``model.path`` when set (``seed`` unused), else ``model.architecture`` built from
    ``model.arch`` with initial weights drawn from ``seed`` (the global RNG is left untouched).
    """
    if model_cfg.path is not None:
        return load_causal_lm(model_cfg.path, dtype)
    return build_from_arch(model_cfg, tokenizer, dtype, seed)


def build_from_arch(
    model_cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PreTrainedModel:
    """``model.architecture`` (any transformers class: a causal LM, a sequence classifier)
    built from ``model.arch``, sized to ``tokenizer``; weights drawn from ``seed`` without
    touching the global RNG; eval mode, on CPU."""
    model_class = architecture_class(model_cfg.architecture)
    config = model_class.config_class(
        **model_cfg.arch,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(dtype).eval()


def load_causal_lm(path: str, dtype: torch.dtype, field: str = "model.path") -> PreTrainedModel:
    """The causal LM of a local folder; ``ConfigError`` naming it when it cannot be loaded."""
    if not Path(path).expanduser().is_dir():
        raise ConfigError(field, f"{path} is not a local folder; fix the path")
    config = load_model_config(path, field)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), config=config, local_files_only=True, dtype=dtype
        )
    except torch.OutOfMemoryError:
        raise  # a resource problem, not the folder's
    except Exception as err:  # missing/truncated weights (OSError, SafetensorError), bad shapes
        text = str(err).strip().splitlines()
        raise ConfigError(
            field,
            f"{path} cannot be loaded by transformers {transformers.__version__} "
            f"({type(err).__name__}: {text[0] if text else 'no message'}); check its weight "
            "files (model.safetensors) against config.json",
        ) from None
    return model.eval()


def architecture_class(name: str) -> type[PreTrainedModel]:
    """``model.architecture`` as a transformers model class; ``ConfigError`` if there is none."""
    model_class = getattr(transformers, name, None)
    if model_class is None or not hasattr(model_class, "config_class"):
        raise ConfigError(
            "model.architecture",
            f"{name!r} is not a model class of transformers {transformers.__version__}; use "
            "the class named in the model's config.json (e.g. Qwen3ForCausalLM)",
        )
    return model_class


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings count once)."""
    return sum(p.numel() for p in model.parameters())
