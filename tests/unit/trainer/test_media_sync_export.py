"""What a vision-language policy publishes and exports: the trainer's weight names are the
engine model's (by name is how engines load), a frozen vision tower takes no gradient and
is not published, checkpoints keep it, and the HF export loads back with transformers as
the same class with its processor files, giving the same logits.

(The real weight-sync round with an engine process: tests/dist/test_weightsync_media.py.)
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from media_batches import GRPO, TEMPERATURE, VL, backend_of, sampled_groups
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from relax_hpc.algo import AlgoConfig
from relax_hpc.checkpoint.stateful import ModelAndOptimizer
from relax_hpc.config.compose import compose_run_config
from relax_hpc.config.errors import ConfigError
from relax_hpc.config.validate import validate_run_config
from relax_hpc.data.media_tasks import MediaTask
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.update import prepare_step, update_critic, update_policy

PPO = AlgoConfig(name="ppo")


@pytest.fixture(scope="module")
def policy():
    return build_media_policy(VL, seed=1)


@pytest.fixture(scope="module")
def batch(policy):
    model, processor = policy
    groups = sampled_groups(model, processor, 2, 4)
    return collate(groups, processor.tokenizer.pad_token_id, processor)


def tower(names) -> set[str]:
    return {n for n in names if n.startswith("model.visual.")}


def trained(policy, batch, freeze_vision: bool, algo: AlgoConfig = GRPO):
    spec, backend = backend_of(policy, 400, algo, freeze_vision=freeze_vision)
    nets = backend.nets
    tensors = prepare_step(spec, batch, nets, TEMPERATURE)
    update_policy(spec, batch, tensors, nets.policy, (1, 1, 0, 1), TEMPERATURE)
    if nets.critic is not None:
        update_critic(spec, batch, tensors, nets.critic, (1, 1, 0, 1))
    return backend


def test_published_names_and_shapes_are_the_engine_models(policy, batch):
    engine_model = MediaTransformersEngine(*build_media_policy(VL, seed=7)).model
    expected = {n: t.shape for n, t in engine_model.state_dict().items()}
    weights = trained(policy, batch, freeze_vision=False).policy_weights()
    assert {n: t.shape for n, t in weights.items()} == expected
    assert tower(weights)


def test_a_frozen_tower_takes_no_gradient_and_is_not_published(policy, batch):
    model, _ = policy
    backend = trained(policy, batch, freeze_vision=True, algo=PPO)
    network = backend.nets.policy.network
    initial = model.state_dict()
    frozen = tower(initial)
    for name, parameter in network.named_parameters():
        if name in frozen:
            assert not parameter.requires_grad and parameter.grad is None
            assert torch.equal(parameter, initial[name]), name
    moved = [n for n, p in network.named_parameters() if not torch.equal(p, initial[n])]
    assert moved and not set(moved) & frozen  # the language model trained
    optimised = {id(p) for g in backend.nets.policy.optimizer.param_groups for p in g["params"]}
    named = dict(network.named_parameters())
    assert not any(id(named[n]) in optimised for n in frozen)
    critic = backend.nets.critic.network  # the critic's body has the tower frozen too
    assert all(not p.requires_grad for n, p in critic.named_parameters() if ".visual." in n)
    weights = backend.policy_weights()
    assert set(weights) == set(initial) - frozen
    with pytest.raises(ValueError, match="no vision tower"):
        from relax_hpc.trainer.torch_backend import freeze_tower

        freeze_tower(torch.nn.Linear(2, 2), "vision")


def test_a_checkpoint_of_a_frozen_tower_loads_back(policy, batch):
    backend = trained(policy, batch, freeze_vision=True)
    model = backend.nets.policy
    state = ModelAndOptimizer(model.network, model.optimizer).state_dict()
    _, fresh = backend_of(policy, 400, freeze_vision=True)
    target = fresh.nets.policy
    ModelAndOptimizer(target.network, target.optimizer).load_state_dict(state)
    for name, value in model.network.state_dict().items():
        assert torch.equal(target.network.state_dict()[name], value), name
    assert len(target.optimizer.state) == len(model.optimizer.state) > 0


def test_freeze_vision_needs_a_model_with_a_vision_tower():
    cfg = compose_run_config(["+experiment=grpo_tiny", "trainer.freeze_vision=true"])
    with pytest.raises(ConfigError, match="no vision tower") as err:
        validate_run_config(cfg, check_paths=False)
    assert err.value.field == "trainer.freeze_vision"
    vl = compose_run_config(["+experiment=grpo_qwen3_vl", "trainer.freeze_vision=true"])
    validate_run_config(vl, check_paths=False)


def test_export_loads_back_as_the_same_class_with_its_processor(policy, batch, tmp_path):
    model, processor = policy
    backend = trained(policy, batch, freeze_vision=True)
    backend.export(tmp_path, processor, is_writer=True)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, local_files_only=True)
    network = backend.nets.policy.network
    assert type(loaded) is type(network)
    assert set(loaded.state_dict()) == set(network.state_dict())  # the frozen tower too
    image_processor = AutoImageProcessor.from_pretrained(tmp_path, use_fast=False)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    assert MediaProcessor.from_pretrained(tmp_path).fingerprint == processor.fingerprint
    example = MediaTask("shapes", eval_size=4).example("eval", 2)
    processed = processor.process(example.messages, example.images)
    pixels = image_processor(images=list(processed.payload.images), return_tensors="pt")
    assert torch.equal(pixels["pixel_values"], processed.inputs.tensors["pixel_values"])
    ids = torch.tensor([processed.prompt_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        got = loaded.eval()(**inputs, **pixels).logits
        want = network.eval()(**inputs, **processed.inputs.tensors).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if importlib.util.find_spec("torchvision") is not None:  # AutoProcessor needs it (video)
        from transformers import AutoProcessor

        assert type(AutoProcessor.from_pretrained(tmp_path)).__name__ == "Qwen3VLProcessor"


def test_the_offline_export_writes_the_processor_files_too(policy, batch, tmp_path, monkeypatch):
    from relax_hpc.checkpoint.store import CheckpointStore
    from relax_hpc.config import write_resolved_config
    from relax_hpc.export import export_checkpoint
    from relax_hpc.paths import RunPaths

    monkeypatch.setenv("RELAX_HPC_CACHE_DIR", str(tmp_path / "cache"))
    cfg = compose_run_config(["+experiment=grpo_tiny", f"run_dir={tmp_path / 'run'}"])
    cfg.model = dataclasses.replace(VL, warm_start=True)  # the export must not retrain it
    cfg.seed = 1
    paths = RunPaths(tmp_path / "run").create()
    write_resolved_config(cfg, paths.resolved_config)
    backend = trained(policy, batch, freeze_vision=False)
    store = CheckpointStore(paths, keep=1)
    store.save(1, backend.checkpoint_entries(store.partial_dir(1), saving=True), facts={})
    out = export_checkpoint(paths.root, tmp_path / "export")
    assert (out / "preprocessor_config.json").is_file()
    assert not (tmp_path / "cache").exists()  # no warm start was trained for the skeleton
    loaded = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    for name, value in backend.nets.policy.network.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
