"""Both trainer backends through the one interface of ``trainer/backend.py``.

The same checks for ``torch`` and for ``megatron`` (on CPU over gloo: one process with
Megatron's parallel state, the ``megatron_world`` fixture): build networks, log-probs and
values, a PPO update through the loop's own update functions (forward-backward, optimiser
step), the weights to publish, checkpoint entries saved and loaded through the
``CheckpointStore``, the export loaded back by transformers, the data-parallel layout.
"""

from __future__ import annotations

import copy

import megatron.core  # noqa: F401  (the test extra installs it: missing fails, never skips)
import pytest
import torch
import torch.nn.functional as F
from megatron_factories import right_padded_batch, tiny_qwen3
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.checkpoint.store import CheckpointStore, latest_checkpoint
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.backend import HFNetworks, make_backend
from relax_hpc.trainer.update import prepare_step, update_critic, update_policy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

CPU = torch.device("cpu")
TEMPERATURE = 0.7
ATOL = 1e-5
PPO = resolve(AlgoConfig(name="ppo"))  # a trainable critic and a reference too


@pytest.fixture(params=["torch", "megatron"])
def backend_name(request) -> str:
    if request.param == "megatron":
        request.getfixturevalue("megatron_world")
    return request.param


def built_backend(name: str, seed: int = 0):
    """A backend with a PPO set of networks from one tiny HF model (and that model)."""
    trainer = TrainerConfig(backend=name, lr=1e-2, critic_lr=1e-2, micro_batch_tokens=24)
    backend = make_backend(trainer, CPU, torch.float32, rank=0, world_size=1)
    # Tied embeddings: an untied critic body's lm_head gets no gradient, hence no optimizer
    # state, and a torch resume then misses it (the optimizer's dummy step, issue 15).
    hf = tiny_qwen3(True, seed)
    hf_copy = copy.deepcopy(hf)
    networks = HFNetworks(policy=hf, reference=copy.deepcopy(hf), critic_body=copy.deepcopy(hf))
    backend.build_networks(networks)
    return backend, hf_copy


def hf_response_logprobs(hf, batch, temperature: float) -> torch.Tensor:
    """The reference: HF's logits, tempered, at each response token's position."""
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL).logits
    logprobs_BL = F.log_softmax(logits / temperature, dim=-1)
    next_BL = batch.input_ids_BL.roll(-1, dims=1).unsqueeze(-1)
    logprobs_BL = logprobs_BL.gather(-1, next_BL).squeeze(-1)
    out = torch.zeros_like(batch.response_mask_BT)
    for row, (prompt, response) in enumerate(
        zip(batch.prompt_len_B.tolist(), batch.response_len_B.tolist(), strict=True)
    ):
        out[row, :response] = logprobs_BL[row, prompt - 1 : prompt - 1 + response]
    return out


def batch_of(vocab: int):
    batch = right_padded_batch([3, 5, 2, 4], [4, 1, 6, 3], vocab)
    batch.rewards_B = torch.tensor([1.0, 0.0, 1.0, 0.0])
    return batch


def ppo_step(backend, batch) -> dict[str, float]:
    """One PPO step as the loop takes it (micro-batches of 24 tokens: several per step)."""
    nets = backend.nets
    tensors = prepare_step(PPO, batch, nets, TEMPERATURE)
    plan = (1, 1, *backend.data_parallel_layout())
    metrics = update_policy(PPO, batch, tensors, nets.policy, plan, TEMPERATURE)
    metrics.update(update_critic(PPO, batch, tensors, nets.critic, plan))
    return metrics


def test_outputs_update_weights_and_layout(backend_name):
    backend, hf = built_backend(backend_name)
    nets, batch = backend.nets, batch_of(hf.config.vocab_size)
    mask = batch.response_mask_BT.bool()
    assert backend.data_parallel_layout() == (0, 1)
    assert len(nets.policy.micro_batch_rows(batch)) > 1  # the token budget splits the batch

    expected = hf_response_logprobs(hf, batch, TEMPERATURE)
    for network in (nets.policy, nets.reference):
        logprobs = network.logprobs(batch, TEMPERATURE)
        assert logprobs.shape == batch.response_mask_BT.shape
        torch.testing.assert_close(logprobs[mask], expected[mask], atol=ATOL, rtol=0)
    values = nets.critic.values(batch)
    assert values.shape == batch.response_mask_BT.shape and not values[mask].any()  # zero head

    published = backend.policy_weights()
    initial = hf.state_dict()
    assert published.keys() == initial.keys()
    assert all(torch.equal(published[name], initial[name]) for name in initial)

    metrics = ppo_step(backend, batch)
    assert metrics["grad_norm"] > 0 and metrics["lr"] > 0 and metrics["critic/grad_norm"] > 0
    moved = backend.policy_weights()
    assert any(not torch.equal(moved[name], initial[name]) for name in initial)
    assert nets.critic.values(batch)[mask].abs().sum() > 0  # the critic learned something
    reference = nets.reference.logprobs(batch, TEMPERATURE)
    torch.testing.assert_close(reference[mask], expected[mask], atol=ATOL, rtol=0)  # frozen


def test_checkpoint_entries_round_trip_and_export_loads_in_transformers(backend_name, tmp_path):
    paths = RunPaths(tmp_path / "run")
    store = CheckpointStore(paths, keep=1)
    saved, hf = built_backend(backend_name)
    batch = batch_of(hf.config.vocab_size)
    ppo_step(saved, batch)
    store.save(1, saved.checkpoint_entries(store.partial_dir(1), saving=True))

    loaded, _ = built_backend(backend_name, seed=1)  # other weights until loaded
    info = latest_checkpoint(paths)
    assert info is not None
    store.load(info, loaded.checkpoint_entries(info.path, saving=False))
    saved_weights, loaded_weights = saved.policy_weights(), loaded.policy_weights()
    assert all(torch.equal(saved_weights[name], loaded_weights[name]) for name in saved_weights)
    torch.testing.assert_close(
        loaded.nets.critic.values(batch), saved.nets.critic.values(batch), atol=0, rtol=0
    )
    # The optimisers' states came back too: the next identical step stays identical.
    ppo_step(saved, batch)
    ppo_step(loaded, batch)
    after_saved, after_loaded = saved.policy_weights(), loaded.policy_weights()
    assert all(torch.equal(after_saved[name], after_loaded[name]) for name in after_saved)

    saved.export(tmp_path / "export", build_char_tokenizer(), is_writer=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", local_files_only=True)
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, after_saved[name]), name
    assert AutoTokenizer.from_pretrained(tmp_path / "export", local_files_only=True).vocab
