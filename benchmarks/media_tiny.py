"""Tiny VL / Omni models on their media tasks: processing, training and generation cost.

For the tiny Qwen3-VL on ``shapes`` and the tiny Qwen2.5-Omni thinker on ``pitch`` it
prints, measured in this one run (1 torch thread):

- processor time per sample (row -> token ids + media tensors) and rebuild time from the
  stored payload; payload bytes per sample vs the model-input bytes it rebuilds;
- fwd+bwd of a batch (--rows samples) with media vs the same token ids without media (media
  pad tokens then embed as text): the ratio is what the towers cost;
- generation of a batch (--rows requests, 4 new tokens) with media;
- with --warm-start: the cached warm start's training time (first run only) and greedy
  held-out accuracy on the media vs the blank control (both should be near 25%).

    python benchmarks/media_tiny.py [--rows 128] [--micro 32] [--warm-start CACHE_DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from relax_hpc.data.media_tasks import MediaTask
from relax_hpc.media.decode import MediaColumns, decode_row_media
from relax_hpc.media.inputs import MediaBatch
from relax_hpc.models.multimodal import build_tiny_media_model, load_media_model
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine, media_request
from relax_hpc.tasks.media import media_warm_start
from relax_hpc.trainer.media_logprobs import media_token_logprobs

CASES = {"qwen3_vl": "shapes", "qwen2_5_omni": "pitch"}


def seconds(work: Callable[[], object], repeats: int = 3) -> float:
    work()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - started) / repeats


def train_cost(model, processor, processed, micro: int) -> tuple[float, float]:
    """Seconds of fwd+bwd over the rows in micro-batches, with and without media."""
    rows = [p.prompt_ids + [processor.tokenizer.eos_token_id] for p in processed]
    ids = torch.tensor(rows)  # one task: every row has the same length
    mask, prompt_len = torch.ones_like(ids), torch.full((len(rows),), ids.shape[1] - 1)
    media = MediaBatch([p.inputs for p in processed])

    def step(with_media: bool) -> None:
        for start in range(0, len(rows), micro):
            chunk = list(range(start, min(start + micro, len(rows))))
            kwargs = media.select(chunk).model_kwargs() if with_media else {}
            logprobs, _ = media_token_logprobs(
                model,
                ids[chunk],
                mask[chunk],
                prompt_len[chunk],
                1,
                kwargs,
                processor.media_token_ids,
            )
            logprobs.sum().backward()

    model.train()
    return seconds(lambda: step(True)), seconds(lambda: step(False))


def accuracy(engine, processor, task: MediaTask) -> float:
    examples = [task.example("eval", i) for i in range(len(task.eval))]
    requests = []
    for i, example in enumerate(examples):
        processed = processor.process(example.messages, example.images, example.audio)
        requests.append(
            GenerationRequest(f"e{i}", processed.prompt_ids, media_request(processed.payload))
        )
    completions = engine.generate(requests, SamplingParams(greedy=True, max_new_tokens=4))
    right = sum(c.text.strip() == e.answer for c, e in zip(completions, examples, strict=True))
    return right / len(examples)


def measure(family: str, task_name: str, args: argparse.Namespace) -> dict[str, float]:
    model, processor = build_tiny_media_model(family)
    task = MediaTask(task_name)
    rows = [task.row("train", i) for i in range(args.rows)]

    def process_rows() -> list:
        out = []
        for row in rows:
            images, audio = decode_row_media(row, MediaColumns(), sampling_rate_hz=16000)
            out.append(processor.process(row["prompt"], images, audio))
        return out

    processed = process_rows()
    result = {
        "process_ms_per_sample": 1e3 * seconds(process_rows, 1) / args.rows,
        "rebuild_ms_per_sample": 1e3
        * seconds(lambda: [processor.model_inputs(p.payload) for p in processed], 1)
        / args.rows,
        "payload_kb_per_sample": processed[0].payload.num_bytes / 1024,
        "inputs_kb_per_sample": sum(
            t.numel() * t.element_size() for t in processed[0].inputs.tensors.values()
        )
        / 1024,
        "prompt_tokens": len(processed[0].prompt_ids),
        "media_tokens": processed[0].inputs.num_media_tokens,
    }
    with_media, text_only = train_cost(model, processor, processed, args.micro)
    result.update(
        fwd_bwd_s_media=with_media, fwd_bwd_s_text=text_only, media_over_text=with_media / text_only
    )
    model.eval()
    engine = MediaTransformersEngine(model, processor, max_batch_size=args.micro * 2)
    requests = [
        GenerationRequest(f"g{i}", p.prompt_ids, media_request(p.payload))
        for i, p in enumerate(processed)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    result["generate_s"] = seconds(lambda: engine.generate(requests, params), 1)
    if args.warm_start:
        started = time.perf_counter()
        folder = media_warm_start(family, task_name, args.warm_start)
        result["warm_start_s"] = time.perf_counter() - started
        warm, warm_processor = load_media_model(folder)
        engine = MediaTransformersEngine(warm, warm_processor, max_batch_size=64)
        result["base_accuracy"] = accuracy(engine, warm_processor, task)
        result["blank_accuracy"] = accuracy(
            engine, warm_processor, MediaTask(task_name, blank=True)
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--warm-start", default=None, help="cache folder of the warm starts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for family, task_name in CASES.items():
        result = measure(family, task_name, args)
        print(family, task_name, json.dumps({k: round(v, 4) for k, v in result.items()}))


if __name__ == "__main__":
    main()
