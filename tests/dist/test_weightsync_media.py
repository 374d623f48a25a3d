"""Every trained tensor of a vision-language policy reaches a real media engine process over
a Gloo weight-sync round (the vision tower included), and a frozen tower is not sent.

The trainer side is this process: the torch backend over the tiny Qwen3-VL policy takes a
GRPO step on image prompts, then its ``policy_weights()`` go through ``WeightSender.sync``.
The engine (``media_engine_peer.py``) builds the same policy the way the rollout does and
reports what it received, a CRC of its whole model and its greedy answer to an image.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from media_engine_peer import VL, greedy_answer, sampled_groups
from weightsync_peers import fingerprint, read_status, stop_engines, wait_until

from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine
from relax_hpc.trainer.backend import HFNetworks, make_backend
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.update import prepare_step, update_policy
from relax_hpc.weightsync import WeightSender, WeightSyncConfig

PEER = Path(__file__).with_name("media_engine_peer.py")
SEED = 1
STARTUP_S = 90  # the engine imports torch + transformers and builds its model on 2 busy cores
GRPO = resolve(AlgoConfig(name="grpo"))


def trained_backend(freeze_vision: bool):
    """The torch backend after one GRPO step on image prompts."""
    model, processor = build_media_policy(VL, seed=SEED)
    trainer = TrainerConfig(lr=1e-2, micro_batch_tokens=400, freeze_vision=freeze_vision)
    backend = make_backend(trainer, torch.device("cpu"), torch.float32, rank=0, world_size=1)
    nets = backend.build_networks(HFNetworks(policy=model, processor=processor))
    batch = collate(sampled_groups(model, processor), processor.tokenizer.pad_token_id, processor)
    update_policy(GRPO, batch, prepare_step(GRPO, batch, nets, 1.0), nets.policy, (1, 1, 0, 1), 1.0)
    return backend, processor


@pytest.fixture
def engine_and_sender(tmp_path):
    paths = RunPaths(tmp_path).create()
    config = WeightSyncConfig(
        backend="gloo",
        timeout_s=10.0,
        bucket_mb=1,
        serve_dtype="same",  # float32 on the wire: the engine's model must equal the trainer's
        fs_fallback=False,
        advertise_host="127.0.0.1",
    )
    sender = WeightSender(paths, config, "cpu")
    sender.start()
    args = [sys.executable, str(PEER), str(tmp_path), "e1", str(SEED), json.dumps(vars(config))]
    process = subprocess.Popen(args)

    def admitted() -> bool:
        sender.admit_pending()
        return "e1" in sender.admitted_engines

    wait_until(admitted, STARTUP_S, "the media engine's admission")
    yield paths, sender
    sender.close()
    stop_engines(tmp_path, [process])


def sync_and_read(paths: RunPaths, sender: WeightSender, weights, version: int) -> dict:
    report = sender.sync(weights, version)
    assert report.members == ["e1"] and report.failed == report.dropped == []

    def update_seen():
        records = [r for r in read_status(paths.root, "e1") if r["event"] == "update"]
        return next((r for r in records if r["version"] == version), None)

    return wait_until(update_seen, 60, f"the engine at policy_version {version}")


def test_trained_tensors_reach_the_engine_and_a_frozen_tower_stays_home(engine_and_sender):
    paths, sender = engine_and_sender
    # 1: a frozen tower is neither trained nor sent; the engine's own equals it
    frozen, _ = trained_backend(freeze_vision=True)
    weights = frozen.policy_weights()
    network = frozen.nets.policy.network
    tower = {n for n in network.state_dict() if ".visual." in f".{n}"}
    assert tower and not tower & set(weights)
    record = sync_and_read(paths, sender, weights, 1)
    assert record["received"] == sorted(weights)
    assert record["fingerprint"] == fingerprint(network.state_dict())
    # 2: every tensor, the trained tower included
    backend, processor = trained_backend(freeze_vision=False)
    weights = backend.policy_weights()
    network = backend.nets.policy.network
    assert set(weights) == set(network.state_dict()) >= tower
    initial, _ = build_media_policy(VL, seed=SEED)
    moved = [n for n in tower if not torch.equal(weights[n], initial.state_dict()[n])]
    assert moved, "the GRPO step did not train the vision tower"
    record = sync_and_read(paths, sender, weights, 2)
    assert record["received"] == sorted(weights)
    assert record["fingerprint"] == fingerprint(network.state_dict())
    trainers_view = MediaTransformersEngine(copy.deepcopy(network).eval(), processor)
    assert record["greedy"] == greedy_answer(trainers_view)
