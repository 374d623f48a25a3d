"""Helpers shared by the media trainer tests (tests/unit/trainer on CPU, tests/gpu on a GPU):
spool samples of media prompts sampled by the media engine, and a torch backend over copies
of a policy (a uniquely named module, not a ``conftest.py``)."""

from __future__ import annotations

import copy

import numpy as np
import torch

from relax_hpc.algo import AlgoConfig, AlgorithmSpec, resolve
from relax_hpc.config.schema import ModelConfig, TrainerConfig
from relax_hpc.data.media_tasks import MediaTask
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine, media_request
from relax_hpc.spool import Sample
from relax_hpc.trainer.backend import HFNetworks, TrainerBackend, make_backend

VL = ModelConfig(name="tiny_vl", architecture="Qwen3VLForConditionalGeneration", modality="vision")
OMNI = ModelConfig(
    name="tiny_omni", architecture="Qwen2_5OmniThinkerForConditionalGeneration", modality="omni"
)
TEMPERATURE = 1.0
GRPO = AlgoConfig(name="grpo")


def sampled_groups(
    model, processor, num_groups: int, per_group: int, task_name: str = "shapes"
) -> list[list[Sample]]:
    """Groups of the shapes task (or ``pitch``: an Omni model hears the clip and also sees
    a shapes image) sampled by the media engine at ``TEMPERATURE``; the samples of a group
    share one ``MediaPayload`` object, as the spool returns them; rewards alternate 0/1 so
    that every group has non-zero advantages."""
    engine = MediaTransformersEngine(model, processor)
    task = MediaTask(task_name, eval_size=4)
    shapes = MediaTask("shapes", eval_size=4)
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=4, seed=3)
    groups = []
    for g in range(num_groups):
        example = task.example("train", g + 1)
        if task_name == "pitch":
            image = shapes.example("train", g + 1).images[0]
            messages = [{"role": "user", "content": [{"type": "image"}, *_parts(example)]}]
            processed = processor.process(messages, [image], example.audio)
        else:
            processed = processor.process(example.messages, example.images)
        requests = [
            GenerationRequest(f"{g}/{j}", processed.prompt_ids, media_request(processed.payload))
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
                    media=processed.payload,
                )
                for j, c in enumerate(engine.generate(requests, params))
            ]
        )
    return groups


def _parts(example) -> list:
    content = example.messages[-1]["content"]
    return list(content) if isinstance(content, list) else [{"type": "text", "text": content}]


def backend_of(
    policy,
    micro_batch_tokens: int,
    algo: AlgoConfig = GRPO,
    lr: float = 1e-2,
    **trainer_fields,
) -> tuple[AlgorithmSpec, TrainerBackend]:
    """A torch backend over copies of ``policy`` = (model, processor): the networks ``algo``
    needs (the caller's model stays untouched); ``trainer_fields`` of ``TrainerConfig``."""
    model, processor = policy
    spec = resolve(algo)
    trainer = TrainerConfig(
        lr=lr, critic_lr=lr, micro_batch_tokens=micro_batch_tokens, **trainer_fields
    )
    backend = make_backend(trainer, torch.device("cpu"), torch.float32, rank=0, world_size=1)
    backend.build_networks(
        HFNetworks(
            policy=copy.deepcopy(model),
            reference=copy.deepcopy(model) if spec.needs_reference else None,
            critic_body=copy.deepcopy(model) if spec.needs_critic else None,
            processor=processor,
        )
    )
    return spec, backend
