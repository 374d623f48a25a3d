"""``miniaturize``: a pure function from an experiment to its CPU miniature."""

from __future__ import annotations

import pytest

from relax_hpc.config import ConfigError, validate_run_config
from relax_hpc.config.compose import compose_run_config
from relax_hpc.data.datasets import build_dataset
from relax_hpc.launch.examples import experiment_names
from relax_hpc.miniature import TINY_ARCHITECTURES, miniaturize, write_miniature_data
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.resolve import resolve_names


def dataset_of(cfg):
    """The miniature's train split, read as its components read it (a vision model's
    through its processor)."""
    if cfg.model.modality == "text":
        return build_dataset(cfg.data, build_char_tokenizer())
    from relax_hpc.models.multimodal import tiny_processor

    family = "qwen3_vl" if cfg.model.modality == "vision" else "qwen3_omni"
    if cfg.model.architecture == "Qwen2_5OmniThinkerForConditionalGeneration":
        family = "qwen2_5_omni"
    processor = tiny_processor(family)
    return build_dataset(cfg.data, processor.tokenizer, processor=processor)


@pytest.mark.parametrize("name", sorted(experiment_names()))
def test_a_miniature_is_a_valid_cpu_run_of_the_same_recipe(name, tmp_path):
    recipe = compose_run_config([f"+experiment={name}"])
    cfg = miniaturize(compose_run_config([f"+experiment={name}", "+preset=miniature"]), tmp_path)
    assert cfg.miniature and not recipe.miniature
    validate_run_config(cfg)
    resolve_names(cfg)
    assert (cfg.trainer.backend, cfg.trainer.gpus_per_node, cfg.trainer.total_steps) == (
        "torch",
        0,
        2,
    )
    assert (cfg.rollout.backend, cfg.rollout.gpus_per_node) == ("transformers", 0)
    assert (cfg.cluster.kind, cfg.cluster.max_restarts) == ("local", 0)
    assert cfg.model.path is None and cfg.model.arch == TINY_ARCHITECTURES[cfg.model.architecture]
    assert cfg.model.architecture == recipe.model.architecture
    assert (cfg.rollout.reward, cfg.algo, cfg.mode, cfg.max_staleness) == (
        recipe.rollout.reward,
        recipe.algo,
        recipe.mode,
        recipe.max_staleness,
    )
    assert cfg.observe.alerts.events == []  # a smoke test pages nobody
    # The few rows it writes are read by its data config, in the recipe's schema.
    written = write_miniature_data(cfg)
    assert all(path.parent == tmp_path for path in written)
    train = dataset_of(cfg)
    assert len(train) >= cfg.rollout.prompts_per_step
    records = [train[i] for i in range(min(len(train), 8))]
    assert all(record.answer for record in records)
    if cfg.model.modality == "vision":  # every row's image reached its record
        assert all(record.media is not None for record in records)
    assert write_miniature_data(cfg) == []  # a resumed miniature keeps its rows


def test_the_omni_miniature_rows_hold_an_image_and_a_clip_each(tmp_path):
    cfg = miniaturize(compose_run_config(["+experiment=grpo_qwen3_omni"]), tmp_path)
    write_miniature_data(cfg)
    records = [r for r in (dataset_of(cfg)[i] for i in range(4)) if r is not None]
    assert records and all(len(r.media.images) == len(r.media.audio) == 1 for r in records)


def test_a_family_without_a_tiny_model_is_named(tmp_path):
    cfg = compose_run_config(["+experiment=grpo_qwen3", "model.architecture=LlamaForCausalLM"])
    with pytest.raises(ConfigError, match="no tiny model of LlamaForCausalLM"):
        miniaturize(cfg, tmp_path)


def test_a_reward_model_of_a_folder_becomes_a_tiny_one_built_from_config(tmp_path):
    rm = "{helpful: {path: /models/rm-8b, label: 1, normalize: sigmoid, template: 'Q {response}'}}"
    cfg = compose_run_config(
        [
            "+experiment=grpo_qwen3",
            "rollout.reward=composite",
            "++rewards.weights={dapo_math: 1.0, helpful: 0.5}",
            f"++rewards.reward_models={rm}",
        ]
    )
    tiny = miniaturize(cfg, tmp_path)
    validate_run_config(tiny)
    helpful = tiny.rewards.reward_models["helpful"]
    assert (helpful.path, helpful.warm_start, helpful.tokenizer) == (None, "none", "char")
    assert helpful.arch["num_labels"] == 2 and helpful.arch["hidden_size"] == 64
    assert (helpful.label, helpful.normalize, helpful.template) == (1, "sigmoid", "Q {response}")
    assert tiny.rewards.weights == cfg.rewards.weights
    unknown = rm.replace("label: 1,", "label: 1, architecture: GPT2ForSequenceClassification,")
    cfg = compose_run_config(
        ["+experiment=grpo_qwen3", "rollout.reward=helpful", f"++rewards.reward_models={unknown}"]
    )
    with pytest.raises(ConfigError, match="no tiny model of GPT2ForSequenceClassification"):
        miniaturize(cfg, tmp_path)
