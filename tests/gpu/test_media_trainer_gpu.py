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

from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.config.schema import ModelConfig, TrainerConfig
from relax_hpc.data.media_tasks import MediaTask
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine, media_request
from relax_hpc.spool import Sample
from relax_hpc.trainer.backend import HFNetworks, make_backend
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.update import prepare_step, update_policy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
VL = ModelConfig(name="tiny_vl", architecture="Qwen3VLForConditionalGeneration", modality="vision")
GRPO = resolve(AlgoConfig(name="grpo"))


def image_groups(engine: MediaTransformersEngine, num_groups: int = 2, per_group: int = 4):
    task = MediaTask("shapes", eval_size=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
    groups = []
    for g in range(num_groups):
        example = task.example("train", g + 1)
        p = engine.processor.process(example.messages, example.images)
        requests = [
            GenerationRequest(f"{g}/{j}", p.prompt_ids, media_request(p.payload))
            for j in range(per_group)
        ]
        groups.append(
            [
                Sample(
                    sample_id=c.sample_id,
                    group_id=str(g),
                    data_index=g,
                    prompt_token_ids=np.asarray(c.prompt_ids, np.int32),
                    response_token_ids=np.asarray(c.token_ids, np.int32),
                    loss_mask=np.ones(len(c.token_ids), np.uint8),
                    rollout_logprobs=np.asarray(c.logprobs, np.float32),
                    reward=float(j % 2),
                    policy_version=0,
                    finish_reason=c.finish_reason,
                    media=p.payload,
                )
                for j, c in enumerate(engine.generate(requests, params))
            ]
        )
    return groups


def test_a_bf16_grpo_step_on_images_on_a_gpu(tmp_path):
    device = torch.device("cuda", 0)
    model, processor = build_media_policy(VL, torch.bfloat16, seed=1)
    engine = MediaTransformersEngine(model.to(device), processor)
    groups = image_groups(engine)
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
