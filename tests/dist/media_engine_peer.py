"""A rollout engine process for the media weight-sync test: the tiny Qwen3-VL policy built
by ``build_media_policy`` (as the rollout worker builds it) in a ``MediaTransformersEngine``,
loading each update through a real ``WeightReceiver``.

After each update it appends one JSON line to ``<root>/test_status/<id>.jsonl``: the names
it received, a CRC of its whole model state (every tensor, by name) and its greedy answer
to an image prompt. It stops when ``<root>/test_status/stop`` exists.

Run: ``python media_engine_peer.py ROOT ENGINE_ID SEED CONFIG_JSON``. Imported, it also
gives the trainer-side tests their image batches (``sampled_groups``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from weightsync_peers import fingerprint, status_path

from relax_hpc.config.schema import ModelConfig
from relax_hpc.data.media_tasks import MediaTask
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine, media_request
from relax_hpc.spool import Sample
from relax_hpc.weightsync import WeightReceiver, WeightSyncConfig

VL = ModelConfig(name="tiny_vl", architecture="Qwen3VLForConditionalGeneration", modality="vision")


def greedy_answer(engine: MediaTransformersEngine) -> list[int]:
    """The engine's greedy tokens for one shapes prompt (depends on every weight used)."""
    example = MediaTask("shapes", eval_size=4).example("eval", 1)
    processed = engine.processor.process(example.messages, example.images)
    request = GenerationRequest("probe/0", processed.prompt_ids, media_request(processed.payload))
    (completion,) = engine.generate([request], SamplingParams(greedy=True, max_new_tokens=6))
    return completion.token_ids


def sampled_groups(model, processor) -> list[list[Sample]]:
    """Two groups of four samples of the shapes task, one payload per group."""
    engine = MediaTransformersEngine(model, processor)
    task = MediaTask("shapes", eval_size=4)
    groups = []
    for g in range(2):
        example = task.example("train", g + 1)
        p = processor.process(example.messages, example.images)
        requests = [
            GenerationRequest(f"{g}/{j}", p.prompt_ids, media_request(p.payload)) for j in range(4)
        ]
        completions = engine.generate(requests, SamplingParams(max_new_tokens=4, seed=3))
        groups.append(
            [
                Sample(
                    f"{g}/{j}",
                    str(g),
                    g,
                    np.asarray(c.prompt_ids, np.int32),
                    np.asarray(c.token_ids, np.int32),
                    np.ones(len(c.token_ids), np.uint8),
                    np.asarray(c.logprobs, np.float32),
                    float(j % 2),
                    0,
                    c.finish_reason,
                    media=p.payload,
                )
                for j, c in enumerate(completions)
            ]
        )
    return groups


def main(root: Path, engine_id: str, seed: int, config: WeightSyncConfig) -> int:
    torch.set_num_threads(1)
    out = status_path(root, engine_id)
    out.parent.mkdir(exist_ok=True)
    log = out.open("a", buffering=1)
    model, processor = build_media_policy(VL, seed=seed)
    engine = MediaTransformersEngine(model, processor)
    received: set[str] = set()

    def load(tensors) -> None:
        tensors = dict(tensors)
        received.update(tensors)
        engine.load_weights(tensors)

    receiver = WeightReceiver(RunPaths(root), engine_id, config, device="cpu")
    receiver.join(load)
    log.write(json.dumps({"event": "joined"}) + "\n")
    while not (out.parent / "stop").exists():
        update = receiver.poll_for_update(load, wait_s=0.2)
        if update is None:
            continue
        record = {
            "event": "update",
            "version": update.policy_version,
            "received": sorted(received),
            "fingerprint": fingerprint(engine.model.state_dict()),
            "greedy": greedy_answer(engine),
        }
        log.write(json.dumps(record) + "\n")
        received.clear()
    receiver.close()
    return 0


if __name__ == "__main__":
    root, engine_id, seed, config_json = sys.argv[1:5]
    sys.exit(main(Path(root), engine_id, int(seed), WeightSyncConfig(**json.loads(config_json))))
