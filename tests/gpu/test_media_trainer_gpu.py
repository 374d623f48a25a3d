"""The torch trainer on image prompts on a GPU, in bfloat16 with recomputed activations:
the tiny Qwen3-VL's log-probs agree with the media engine's on the same GPU (to bf16
tolerance), a GRPO step trains the vision tower, and the export loads back with
``AutoProcessor`` (torchvision, which Qwen3-VL's video processor needs, is on GPU nodes).
Needs one GPU; skipped otherwise. The exact float32 checks are the CPU tests'
(tests/unit/trainer/test_media_trainer.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from media_batches import VL, sampled_groups

from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.trainer.backend import HFNetworks, make_backend
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.update import prepare_step, update_policy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
GRPO = resolve(AlgoConfig(name="grpo"))


def test_a_bf16_grpo_step_on_images_on_a_gpu(tmp_path):
    device = torch.device("cuda", 0)
    model, processor = build_media_policy(VL, torch.bfloat16, seed=1)
    model = model.to(device)
    groups = sampled_groups(model, processor, num_groups=2, per_group=4)
    batch = collate(groups, processor.tokenizer.pad_token_id, processor)
    trainer = TrainerConfig(lr=1e-3, micro_batch_tokens=200, activation_checkpointing=True)
    backend = make_backend(trainer, device, torch.bfloat16, rank=0, world_size=1)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    nets = backend.build_networks(HFNetworks(policy=model, processor=processor))
    assert len(nets.policy.micro_batch_rows(batch)) > 1
    logprobs = nets.policy.logprobs(batch, 1.0)
    mask = batch.response_mask_BT.bool()
    gap = (logprobs[mask] - batch.rollout_logprobs_BT[mask]).abs()
    assert float(gap.mean()) < 0.02 and float(gap.max()) < 0.1, gap
    tensors = prepare_step(GRPO, batch, nets, 1.0)
    metrics = update_policy(GRPO, batch, tensors, nets.policy, (1, 1, 0, 1), 1.0)
    assert np.isfinite(list(metrics.values())).all()
    weights = backend.policy_weights()
    tower = [n for n in weights if n.startswith("model.visual.")]
    assert any(not torch.equal(weights[n].cpu(), initial[n].cpu()) for n in tower)
    backend.export(tmp_path, processor, is_writer=True)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, local_files_only=True)
    assert type(loaded).__name__ == VL.architecture
    pytest.importorskip("torchvision", reason="AutoProcessor of Qwen3-VL needs torchvision")
    assert type(AutoProcessor.from_pretrained(tmp_path)).__name__ == "Qwen3VLProcessor"
