"""``mode=sync``: the rollout engine hands its memory to the trainer between batches.

Measured on the transformers engine on CPU: the bytes of tensor storage the engine's model
holds (on a GPU, exactly the GPU memory the trainer gets; on CPU the host copy lives in the
same memory). The weight receiver is replaced by a stand-in that plays the trainer's side
(new weights after each step): the receiver itself needs a trainer process and is tested
in tests/dist; here the subject is the loop and the engine.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3, tiny_qwen3_arch

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.data.sampler import PromptSampler
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.rollout.assignment import GroupAssignment
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine
from relax_hpc.rollout.loop import RolloutSettings, RolloutWorker
from relax_hpc.spool import ShardWriter

ARCH = tiny_qwen3_arch(hidden_size=64, intermediate_size=128, head_dim=32)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)


def tiny_model(seed: int) -> torch.nn.Module:
    return tiny_qwen3(ARCH, seed)[0]


def resident_bytes(engine: TransformersEngine) -> int:
    """Bytes of storage behind the engine's parameters and buffers (tied ones once)."""
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


def generate(engine: TransformersEngine) -> list[list[int]]:
    ids = engine.tokenizer("12+34=")["input_ids"]
    requests = [GenerationRequest(f"g/{j}", ids) for j in range(3)]
    return [c.token_ids for c in engine.generate(requests, PARAMS)]


def test_release_frees_the_weights_and_generation_takes_them_back():
    engine = TransformersEngine(tiny_model(seed=0), build_char_tokenizer())
    before, held = generate(engine), resident_bytes(engine)
    engine.release_memory()
    engine.release_memory()  # idempotent
    assert resident_bytes(engine) == 0 < held
    assert generate(engine) == before  # resumed: the same weights, the same samples
    assert resident_bytes(engine) == held


def test_weights_loaded_while_released_are_the_ones_generated_with():
    engine = TransformersEngine(tiny_model(seed=0), build_char_tokenizer())
    newer = tiny_model(seed=1)
    expected = generate(TransformersEngine(newer, build_char_tokenizer()))
    engine.release_memory()
    engine.load_weights(newer.state_dict())  # what the weight receiver calls
    assert generate(engine) == expected


def test_a_model_loaded_from_a_folder_releases_and_takes_back_its_weights(tmp_path):
    """from_pretrained on CPU leaves the weights memory-mapped from the safetensors file
    (storage that cannot be resized: mode=sync of a warm-started or folder model failed)."""
    from transformers import AutoModelForCausalLM

    tiny_model(seed=0).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not all(p.untyped_storage().resizable() for p in model.parameters())
    engine = TransformersEngine(model, build_char_tokenizer())
    before, held = generate(engine), resident_bytes(engine)
    engine.release_memory()
    assert resident_bytes(engine) == 0 < held
    assert generate(engine) == before
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def reloaded(model: torch.nn.Module, folder, **save) -> torch.nn.Module:
    """``model`` as a user's folder gives it: saved, loaded back memory-mapped."""
    model.save_pretrained(folder, **save)
    return type(model).from_pretrained(folder, local_files_only=True).eval()


def on_one_borrowed_buffer(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter and buffer a view into one buffer torch did not allocate (and so cannot
    resize), as a loader that maps one file may hand them out; tied weights stay tied."""
    tensors = list({t.untyped_storage().data_ptr(): t for t in model.parameters()}.values())
    tensors += list(model.buffers())
    borrowed = torch.frombuffer(bytearray(sum(t.nbytes for t in tensors)), dtype=torch.uint8)
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            view = borrowed[offset : offset + tensor.nbytes].view(tensor.dtype)
            view.copy_(tensor.reshape(-1))
            tensor.set_(view.untyped_storage(), offset // tensor.element_size(), tensor.shape)
            offset += tensor.nbytes
    return model


def released_and_resumed_twice(engine: TransformersEngine) -> None:
    """Generation is unchanged across two release/resume cycles, one with new weights."""
    before, held = generate(engine), resident_bytes(engine)
    weights = {name: t.clone() for name, t in engine.model.state_dict().items()}
    for _ in range(2):
        engine.release_memory()
        assert resident_bytes(engine) == 0 < held
        assert generate(engine) == before
        assert resident_bytes(engine) == held
        engine.release_memory()  # a resumed engine that gets weights again
        engine.load_weights(weights)


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_a_model_memory_mapped_from_a_folder_is_released(tmp_path, shard):
    save = {"max_shard_size": shard} if shard else {}
    model = reloaded(tiny_model(seed=0), tmp_path, **save)
    files = len(list(tmp_path.glob("*.safetensors")))
    assert files > 1 if shard else files == 1
    assert not model.lm_head.weight.untyped_storage().resizable()  # what crashed mode=sync
    engine = TransformersEngine(model, build_char_tokenizer())
    released_and_resumed_twice(engine)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_weights_sharing_one_storage_are_released_and_stay_shared():
    model = on_one_borrowed_buffer(tiny_model(seed=0))
    assert len({t.untyped_storage().data_ptr() for t in model.parameters()}) == 1
    engine = TransformersEngine(model, build_char_tokenizer())
    released_and_resumed_twice(engine)
    assert len({t.untyped_storage().data_ptr() for t in model.parameters()}) == 1
    model.model.embed_tokens.weight.data[0, 0] = 7.0
    assert model.lm_head.weight[0, 0] == 7.0


class TrainerSide:
    """Stands in for the weight receiver: while the rollout waits, the trainer trains (the
    engine's memory is measured then), then its new weights arrive."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine
        self.while_training: list[int] = []

    def wait_for(self, min_version: int, should_stop) -> bool:
        self.while_training.append(resident_bytes(self.engine))
        if self.engine.policy_version < min_version:
            self.engine.load_weights(tiny_model(seed=min_version).state_dict())
            self.engine.policy_version = min_version
        return True


def run_worker(tmp_path, colocated: bool, batches: int = 3) -> tuple[list[int], list[int]]:
    """Resident bytes while the trainer trains, and while the engine generates."""
    tokenizer = build_char_tokenizer()
    engine = TransformersEngine(tiny_model(seed=0), tokenizer)
    while_generating: list[int] = []
    engine.model.register_forward_pre_hook(
        lambda module, args: while_generating.append(resident_bytes(engine))
    )
    trainer = TrainerSide(engine)
    worker = RolloutWorker(
        settings=RolloutSettings(
            prompts_per_step=2,
            n_samples_per_prompt=2,
            max_staleness=0,
            eval_interval_steps=0,
            seed=1,
            colocated=colocated,
        ),
        engine=engine,
        sampler=PromptSampler(build_dataset(DataConfig(), tokenizer), seed=1),
        score=lambda pairs: [(0.0, {}) for _ in pairs],
        writer=ShardWriter(tmp_path / "spool", "w0"),
        weights=trainer,
        params=PARAMS,
        metrics=MetricsLogger(None, None),
        assignment=GroupAssignment(tmp_path / "assign", "r0", 2, 2, lease_s=60),
        should_stop=lambda: len(trainer.while_training) > batches,
    )
    assert worker.run() == 0
    return trainer.while_training[1:], while_generating  # [0]: before the first batch


@pytest.mark.parametrize("colocated", [True, False])
def test_sync_mode_engine_memory_is_lower_while_the_trainer_trains(tmp_path, colocated):
    while_training, while_generating = run_worker(tmp_path, colocated)
    assert len(while_training) == 3 and while_generating
    if colocated:
        assert max(while_training) < 0.01 * min(while_generating)
    else:  # the control: without colocation the engine keeps everything
        assert min(while_training) == max(while_generating)
