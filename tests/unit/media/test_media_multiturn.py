"""Images across turns: an environment's observation images reach the next turn's prompt
(engine) and the trajectory's media (trainer), with the tiny Qwen3-VL from config through
the real episode driver, engine, spool shard and trainer log-probs."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from media_fixtures import random_image, tiny

from relax_hpc.media.inputs import MediaBatch
from relax_hpc.models.chat_format import ChatFormat
from relax_hpc.rollout.engines.base import SamplingParams
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine
from relax_hpc.rollout.envs import Environment, EnvRuntime, Observation, StepResult
from relax_hpc.rollout.envs.brighter import BrighterEnv
from relax_hpc.rollout.multiturn import EpisodeBudget, EpisodeRequest, EpisodeRunner
from relax_hpc.rollout.trajectory import to_sample
from relax_hpc.spool.format import read_shard, write_shard_file
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.media_logprobs import media_token_logprobs

PARAMS = SamplingParams(temperature=1.2, max_new_tokens=6, seed=3)
BUDGET = EpisodeBudget(max_turns=3, max_response_tokens=400)


class RecordingMediaEngine(MediaTransformersEngine):
    """The real media engine, remembering every request (id, ids, images) it was sent."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: dict[str, tuple[list[int], list[np.ndarray]]] = {}
        self.lock = threading.Lock()

    def generate(self, requests, params):
        with self.lock:
            for r in requests:
                images = list((r.multimodal or {}).get("image", ()))
                self.requests[r.sample_id] = (list(r.prompt_ids), images)
        return super().generate(requests, params)


class LookAgainEnv(Environment):
    """Keeps the dataset's image prompt; the first step shows a second image, the next ends."""

    def reset(self, row, seed):
        self.second = random_image(48, 64, seed=seed % 1000)
        return None

    def step(self, action):
        if action.turn == 0:
            parts = [{"type": "text", "text": "now this:"}, {"type": "image"}]
            return StepResult(
                Observation(({"role": "user", "content": parts},), images=(self.second,))
            )
        return StepResult(reward=1.0, done=True)


def run(env_class, requests, options=None, vision=True):
    model, media_processor = tiny("qwen3_vl")
    engine = RecordingMediaEngine(model, media_processor)
    runner = EpisodeRunner(
        engine,
        ChatFormat(media_processor.tokenizer),
        env_class,
        EnvRuntime(options=options or {}),
        BUDGET,
        seed=5,
        media_processor=media_processor if vision else None,
    )
    try:
        return engine, runner.run(requests, PARAMS)
    finally:
        runner.close()


def image_pad_count(processor, ids) -> int:
    pad = processor.tokenizer.convert_tokens_to_ids(processor.markup.image_pad)
    return sum(1 for t in ids if t == pad)


def trainer_logprobs(trajectory) -> torch.Tensor:
    """The torch backend's log-probs of the response (media_token_logprobs, one row)."""
    model, processor = tiny("qwen3_vl")
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    media = MediaBatch([processor.model_inputs(trajectory.media)])
    with torch.no_grad():
        logprobs, _ = media_token_logprobs(
            model,
            ids,
            torch.ones_like(ids),
            torch.tensor([len(trajectory.prompt_ids)]),
            len(trajectory.response_ids),
            media.model_kwargs(),
            processor.media_token_ids,
            PARAMS.temperature,
        )
    return logprobs[0]


def assert_trainer_matches_engine(trajectory) -> None:
    mask = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
    got = trainer_logprobs(trajectory)[mask]
    expected = torch.tensor(trajectory.rollout_logprobs)[mask]
    assert torch.allclose(got, expected, atol=2e-5), (got - expected).abs().max()


def test_brighter_shows_one_image_per_turn_and_the_second_turn_sees_both():
    _, processor = tiny("qwen3_vl")
    requests = [EpisodeRequest(f"{g}/0", [], {"seed": g}) for g in range(3)]
    engine, trajectories = run(BrighterEnv, requests, options={"size_px": 64})
    for trajectory in trajectories:
        assert trajectory.num_turns == 2 and trajectory.end_reason == "done"
        first, second = trajectory.media.images  # image A from reset, image B observed
        assert first.shape == second.shape == (64, 64, 3)
        assert len({int(first[0, 0, 0]), int(second[0, 0, 0])}) == 2
        turn0_ids, turn0_images = engine.requests[trajectory.sample_id]
        turn1_ids, turn1_images = engine.requests[f"{trajectory.sample_id}#t1"]
        assert [i[0, 0, 0] for i in turn0_images] == [first[0, 0, 0]]
        assert [i[0, 0, 0] for i in turn1_images] == [first[0, 0, 0], second[0, 0, 0]]
        context = trajectory.prompt_ids + trajectory.response_ids
        assert turn1_ids == context[: len(turn1_ids)]
        assert trajectory.turns[1].num_model_tokens > 0
        # image B's tokens sit in the observation, out of the loss
        per_image = image_pad_count(processor, trajectory.prompt_ids)
        observation = [
            t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if not m
        ]
        assert per_image == 4 and image_pad_count(processor, observation) == per_image
        assert image_pad_count(processor, trajectory.response_ids) == per_image
        assert trajectory.reward in (0.0, 1.0)
        assert_trainer_matches_engine(trajectory)


def test_observation_images_follow_the_prompts_through_the_spool_into_the_trainer(tmp_path):
    """A group of image prompts whose episodes each observe their own image: per-sample
    payloads in a real shard, collated by the trainer to the engine's log-probs."""
    _, processor = tiny("qwen3_vl")
    prompts = [processor.process("<image> look:", [random_image(40, 56, seed=g)]) for g in (1, 2)]
    requests = [
        EpisodeRequest(f"{g}/{j}", p.prompt_ids, {}, p.payload)
        for g, p in enumerate(prompts)
        for j in range(2)
    ]
    engine, trajectories = run(LookAgainEnv, requests)
    for trajectory, request in zip(trajectories, requests, strict=True):
        assert trajectory.num_turns == 2 and trajectory.turns[1].num_model_tokens > 0
        prompt_image, observed = trajectory.media.images
        assert prompt_image is request.media.images[0]  # the prompt's first, then the observed
        assert [len(engine.requests[f"{request.sample_id}#t1"][1])] == [2]
        assert image_pad_count(processor, trajectory.response_ids) > 0
    groups = [[to_sample(t, str(g), g) for t in trajectories[2 * g : 2 * g + 2]] for g in range(2)]
    assert groups[0][0].media is not groups[0][1].media  # each episode its own images
    write_shard_file(tmp_path / "s.h5", groups, "w0", 0.0)
    _, read = read_shard(tmp_path / "s.h5")
    batch = collate(read, processor.tokenizer.pad_token_id, processor)
    model, _ = tiny("qwen3_vl")
    with torch.no_grad():
        logprobs_BT, _ = media_token_logprobs(
            model,
            batch.input_ids_BL,
            batch.attention_mask_BL,
            batch.prompt_len_B,
            batch.response_mask_BT.shape[1],
            batch.media_kwargs(),
            processor.media_token_ids,
            PARAMS.temperature,
        )
    mask_BT = batch.response_mask_BT.bool()
    assert mask_BT.sum() > 0 and (~mask_BT & (batch.response_len_B[:, None] > 0)).any()
    difference = (logprobs_BT - batch.rollout_logprobs_BT)[mask_BT].abs().max()
    assert difference < 2e-5
    # the control: another observed image of the same size changes the second turn's
    # log-probs far beyond float noise, so the image the trainer rebuilt is the one observed
    trajectory = trajectories[0]
    prompt_image, observed = trajectory.media.images
    swapped = dataclasses.replace(trajectory.media, images=(prompt_image, 255 - observed))
    second = torch.zeros(len(trajectory.loss_mask), dtype=torch.bool)
    second[trajectory.turns[1].start :] = True
    honest = trainer_logprobs(trajectory)[second]
    trajectory.media = swapped
    assert (trainer_logprobs(trajectory)[second] - honest).abs().max() > 1e-3


class UnmarkedImageEnv(Environment):
    def reset(self, row, seed):
        return None

    def step(self, action):
        observation = Observation(
            ({"role": "user", "content": "see"},), images=(random_image(8, 8),)
        )
        return StepResult(observation)


@pytest.mark.parametrize(
    ("env_class", "vision", "message"),
    [
        (BrighterEnv, False, "images in observations need a vision model"),
        (UnmarkedImageEnv, True, "the observation has 0 image parts for 1 images"),
    ],
)
def test_images_need_a_vision_model_and_one_part_each(env_class, vision, message):
    """Either ends the episode with the reason (env_error), never the rollout."""
    _, processor = tiny("qwen3_vl")
    ids = processor.tokenizer("hi")["input_ids"]
    _, (trajectory,) = run(env_class, [EpisodeRequest("0/0", ids, {})], vision=vision)
    assert trajectory.end_reason == "env_error"
    assert message in trajectory.info["env_error"]
