"""The policy of a run whose model reads images (``model.modality`` not ``text``): the model
and its ``MediaProcessor``, built the same way by the trainer and by the rollout, so the two
processes agree on names, shapes, initial weights and media inputs.

Two sources, as for text models (``models.build``): a local Hugging Face folder
(``model.path``: its saved class and processor files), or a tiny built-in model of
``model.architecture`` from config (``models.multimodal``: ``TINY_ARCH`` deep-merged with
``model.arch``, the offline tokenizer and processor), or with ``model.warm_start`` the
folder of its warm start on a media task, which the caller asks the run's task for
(``tasks.registry.policy_warm_start``: ``tasks.media``, cached). ``model.tokenizer`` is not
read: the tokenizer is the processor's.

Must not: download anything, or know about training, rollout or the run directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import ModelConfig
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.architectures import media_family
from relax_hpc.models.multimodal import build_tiny_media_model, load_media_model


def is_media_model(model_cfg: ModelConfig) -> bool:
    """Whether the policy takes media (and so is built here, not by ``models.build``)."""
    return model_cfg.modality != "text"


def build_media_policy(
    model_cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    *,
    warm_start_folder: str | Path | None = None,
) -> tuple[PreTrainedModel, MediaProcessor]:
    """``(model, processor)`` of ``model_cfg``: eval mode, on the CPU, in ``dtype``.

    From ``model.path`` when set; else the built-in tiny model drawn from ``seed``, or with
    ``model.warm_start`` the warm-started ``warm_start_folder`` (the run's task's, which
    trainer and rollout both ask for, so both load the same cached model). The caller
    moves the model and sets train mode.
    """
    if model_cfg.path is not None:
        return load_media_policy(model_cfg.path, dtype)
    family = media_family(model_cfg.architecture)
    if model_cfg.warm_start:
        if warm_start_folder is None:
            raise ValueError(
                "model.warm_start: the media policy needs its warm start's folder "
                "(tasks.registry.policy_warm_start)"
            )
        return load_media_model(Path(warm_start_folder), dtype)
    model, processor = build_tiny_media_model(family, model_cfg.arch, seed=seed)
    return model.to(dtype).eval(), processor


def load_media_policy(
    path: str | Path, dtype: torch.dtype, field: str = "model.path"
) -> tuple[PreTrainedModel, MediaProcessor]:
    """The model and processor of a local folder; ``ConfigError`` naming ``field`` when
    they cannot be loaded."""
    if not Path(path).expanduser().is_dir():
        raise ConfigError(field, f"{path} is not a local folder; fix the path")
    try:
        return load_media_model(Path(path).expanduser(), dtype)
    except torch.OutOfMemoryError:
        raise  # a resource problem, not the folder's
    except Exception as err:  # no config/processor files, missing weights, an unknown class
        text = str(err).strip().splitlines()
        raise ConfigError(
            field,
            f"{path} cannot be loaded as a media model by transformers "
            f"{transformers.__version__} ({type(err).__name__}: {text[0] if text else ''}); "
            "it needs config.json, the weights, the tokenizer and preprocessor_config.json",
        ) from None
