"""Build the tokenizer and the causal LM of a ``ModelConfig``, from local files only.

Two sources: a local Hugging Face folder (``model.path``), or a transformers architecture
built from ``model.arch`` with the vocabulary size and special-token ids taken from the
tokenizer (the tiny CPU model). Both the trainer and the rollout build their model here, so
the two processes agree on names, shapes and initial weights.

Must not: download anything (every ``from_pretrained`` is ``local_files_only=True``), or
know about training, rollout or the run directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.config.schema import ModelConfig
from relax_hpc.models.tokenizer import build_char_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """``model.dtype`` as a torch dtype; ``auto`` is float32 on CPU and bfloat16 on GPU."""
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"model.dtype: unknown dtype {name!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def build_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """``model.tokenizer``: ``char`` (built in), ``auto`` (from ``model.path``) or a folder."""
    if model_cfg.tokenizer == "char":
        return build_char_tokenizer()
    folder = model_cfg.path if model_cfg.tokenizer == "auto" else model_cfg.tokenizer
    if folder is None:
        raise ValueError(
            "model.tokenizer: 'auto' needs model.path; set model.tokenizer=char or a folder"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
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
        if not Path(model_cfg.path).is_dir():
            raise ValueError(f"model.path: {model_cfg.path} is not a local folder")
        model = AutoModelForCausalLM.from_pretrained(
            str(model_cfg.path), local_files_only=True, dtype=dtype
        )
        return model.eval()
    model_class = getattr(transformers, model_cfg.architecture, None)
    if model_class is None or not hasattr(model_class, "config_class"):
        raise ValueError(
            f"model.architecture: {model_cfg.architecture!r} is not a transformers model class"
        )
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


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings count once)."""
    return sum(p.numel() for p in model.parameters())
