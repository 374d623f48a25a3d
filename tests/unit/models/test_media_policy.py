"""The one builder of a media policy (trainer and rollout): from config, warm start, folder."""

from __future__ import annotations

import json

import pytest
import torch

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import ModelConfig
from relax_hpc.models.media_policy import build_media_policy, is_media_model
from relax_hpc.models.multimodal import save_media_model, tiny_processor
from relax_hpc.tasks.media import MediaWarmStartConfig, media_warm_start
from relax_hpc.tasks.warm_start import LOCKS_DIR

VL = "Qwen3VLForConditionalGeneration"


def vl_config(**overrides) -> ModelConfig:
    fields = {"name": "tiny_vl", "architecture": VL, "modality": "vision", **overrides}
    return ModelConfig(**fields)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_built_in_model_merges_arch_and_is_the_same_in_both_roles():
    cfg = vl_config(arch={"text_config": {"num_hidden_layers": 1}})
    model, processor = build_media_policy(cfg, seed=3)
    assert type(model).__name__ == VL and not model.training
    assert model.config.text_config.num_hidden_layers == 1
    assert model.config.text_config.hidden_size == 64  # the rest of TINY_ARCH kept
    assert processor.fingerprint == tiny_processor("qwen3_vl").fingerprint
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids(
        processor.markup.image_pad
    )
    again, _ = build_media_policy(cfg, seed=3)  # what the other role builds
    assert same_weights(model, again)
    assert not same_weights(model, build_media_policy(cfg, seed=4)[0])
    assert is_media_model(cfg) and not is_media_model(ModelConfig(name="text"))


def test_bfloat16_is_honoured():
    model, _ = build_media_policy(vl_config(), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_warm_start_is_cached_and_loaded_from_the_cache(tmp_path):
    recipe = MediaWarmStartConfig(steps=2, batch_size=4, warmup_steps=1)
    cfg = vl_config(warm_start=True)
    trained = media_warm_start("qwen3_vl", "shapes", tmp_path, recipe)  # what the task gives
    model, processor = build_media_policy(cfg, warm_start_folder=trained)
    (folder,) = (p for p in tmp_path.iterdir() if p.name != LOCKS_DIR)
    assert json.loads((folder / "warmstart.json").read_text())["inputs"]["task"] == "shapes"
    assert type(model).__name__ == VL
    fresh, _ = build_media_policy(vl_config(), seed=recipe.seed)
    assert not same_weights(model, fresh)  # trained
    cached = media_warm_start("qwen3_vl", "shapes", tmp_path, recipe)
    again, _ = build_media_policy(cfg, warm_start_folder=cached)
    assert same_weights(model, again) and len(list(tmp_path.iterdir())) == 2  # + .locks
    assert processor.fingerprint == tiny_processor("qwen3_vl").fingerprint


def test_a_folder_loads_as_its_class_with_its_processor(tmp_path):
    built, processor = build_media_policy(vl_config(), seed=1)
    save_media_model(tmp_path / "vl", built, processor)
    model, loaded = build_media_policy(vl_config(path=str(tmp_path / "vl")))
    assert type(model) is type(built) and same_weights(model, built)
    assert loaded.fingerprint == processor.fingerprint


def test_bad_sources_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="model.architecture.*Qwen3VLForConditionalGeneration"):
        build_media_policy(vl_config(architecture="Qwen3ForCausalLM"))
    with pytest.raises(ConfigError, match="model.path.*not a local folder"):
        build_media_policy(vl_config(path=str(tmp_path / "missing")))
    built, processor = build_media_policy(vl_config())
    built.save_pretrained(tmp_path / "no_processor")  # weights and config, no processor files
    with pytest.raises(ConfigError, match="model.path.*preprocessor_config.json"):
        build_media_policy(vl_config(path=str(tmp_path / "no_processor")))


def test_a_built_in_media_model_validates_with_its_own_tokenizer():
    import dataclasses

    from relax_hpc.config.compose import compose_run_config
    from relax_hpc.config.validate import validate_run_config
    from relax_hpc.resolve import resolve_names

    cfg = compose_run_config(["+experiment=grpo_tiny"])
    cfg.model = vl_config()  # no path, no arch (TINY_ARCH), tokenizer auto
    validate_run_config(cfg, check_paths=False)
    resolve_names(cfg, check_paths=False)
    cfg.model = vl_config(tokenizer="char")
    with pytest.raises(ConfigError, match="model.tokenizer.*set model.tokenizer=auto"):
        validate_run_config(cfg, check_paths=False)
    cfg.model = dataclasses.replace(vl_config(), architecture="Qwen2VLForConditionalGeneration")
    with pytest.raises(ConfigError, match="model.architecture.*has no built-in media model"):
        resolve_names(cfg, check_paths=False)


@pytest.mark.slow
def test_two_processes_needing_the_warm_start_train_it_once(tmp_path):
    """A media run's trainer and rollout both build the warm start as they start (on 2
    cores they both trained it, 83 s each, before the lock). Both processes import first,
    then wait for one go: they ask for the warm start within milliseconds of each other,
    so without the lock both would train (a few steps take seconds)."""
    import subprocess
    import sys
    import time

    script = (
        "import logging, pathlib, sys, time\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from relax_hpc.config.schema import ModelConfig\n"
        "from relax_hpc.models.media_policy import build_media_policy\n"
        "from relax_hpc.tasks.media import MediaWarmStartConfig, media_warm_start\n"
        "cfg = ModelConfig(name='v', architecture='Qwen3VLForConditionalGeneration',"
        " modality='vision', warm_start=True)\n"
        "recipe = MediaWarmStartConfig(steps=5, batch_size=4, warmup_steps=1)\n"
        "pathlib.Path(sys.argv[2]).touch()\n"
        "while not pathlib.Path(sys.argv[3]).exists():\n"
        "    time.sleep(0.005)\n"
        "folder = media_warm_start('qwen3_vl', 'shapes', sys.argv[1], recipe)\n"
        "build_media_policy(cfg, warm_start_folder=folder)\n"
    )
    cache, go = tmp_path / "cache", tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(cache), str(flag), str(go)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for flag in ready
    ]
    deadline = time.monotonic() + 300
    while not all(flag.exists() for flag in ready):
        ended = [run.returncode for run in runs if run.poll() is not None]
        assert not ended and time.monotonic() < deadline, f"not ready: exits {ended}"
        time.sleep(0.05)
    go.touch()
    logs = [run.communicate(timeout=300)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], logs
    trained = [log for log in logs if "media-warmstart: trained in" in log]
    assert len(trained) == 1, logs  # the other waited, then read the cache


def test_qwen2_audio_is_refused_at_submit_with_the_reason(tmp_path):
    import dataclasses

    from relax_hpc.config.compose import compose_run_config
    from relax_hpc.resolve import resolve_names

    cfg = compose_run_config(["+experiment=grpo_tiny"])
    for path in (None, str(tmp_path)):  # built in, or a folder of that class
        cfg.model = dataclasses.replace(
            vl_config(),
            modality="audio",
            architecture="Qwen2AudioForConditionalGeneration",
            path=path,
        )
        with pytest.raises(ConfigError, match="model.architecture.*Qwen2-Audio .* not supported"):
            resolve_names(cfg, check_paths=False)
