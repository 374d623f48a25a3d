"""Tiny random Qwen3 / Qwen3-MoE models, right-padded batches, and the two-process harness of
the trainer tests."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import warnings

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from relax_hpc.trainer.batch import TrainBatch

TINY_QWEN3 = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "max_position_embeddings": 64,
}


def tiny_qwen3(tie_word_embeddings: bool, seed: int = 0) -> Qwen3ForCausalLM:
    """Random weights, norms included (HF initialises them to ones, which hides mix-ups)."""
    torch.manual_seed(seed)
    config = Qwen3Config(**TINY_QWEN3, tie_word_embeddings=tie_word_embeddings)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def tiny_qwen3_moe(seed: int = 0, norm_topk_prob: bool = False) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        **TINY_QWEN3,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
    )
    return Qwen3MoeForCausalLM(config).eval()


def right_padded_batch(prompt_lens: list[int], response_lens: list[int], vocab: int) -> TrainBatch:
    lengths = [p + r for p, r in zip(prompt_lens, response_lens, strict=True)]
    batch, width = len(lengths), max(response_lens)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, vocab, (batch, max(lengths)), generator=generator)
    attention = torch.zeros_like(input_ids)
    response_mask = torch.zeros(batch, width)
    for row, (length, response) in enumerate(zip(lengths, response_lens, strict=True)):
        input_ids[row, length:] = 0
        attention[row, :length] = 1
        response_mask[row, :response] = 1.0
    return TrainBatch(
        input_ids_BL=input_ids,
        attention_mask_BL=attention,
        prompt_len_B=torch.tensor(prompt_lens),
        response_len_B=torch.tensor(response_lens),
        response_mask_BT=response_mask,
        rollout_logprobs_BT=torch.zeros(batch, width),
        rewards_B=torch.zeros(batch),
        group_index_B=torch.zeros(batch, dtype=torch.long),
        policy_version_B=torch.zeros(batch, dtype=torch.long),
        sample_ids=[f"s{row}" for row in range(batch)],
    )


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(target, *args, world_size: int = 2, timeout_s: float = 180) -> list[dict]:
    """``target(rank, world_size, port, results, *args)`` in ``world_size`` spawned
    processes; their reports (one ``results.put`` each) sorted by ``"rank"``; every process
    must exit 0."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_loopback_port()
    peers = [
        context.Process(target=target, args=(rank, world_size, port, results, *args))
        for rank in range(world_size)
    ]
    for peer in peers:
        peer.start()
    reports = sorted((results.get(timeout=timeout_s) for _ in peers), key=lambda r: r["rank"])
    for peer in peers:
        peer.join(timeout=60)
        assert peer.exitcode == 0, f"rank exited with {peer.exitcode}"
    return reports


class _Tagged:
    """A results queue that tags every report with the peer that sent it."""

    def __init__(self, results, name: str) -> None:
        self.results, self.name = results, name

    def put(self, report: dict) -> None:
        self.results.put({**report, "peer": self.name})


def _peers_in_turn(rank: int, world_size: int, ports: list[int], results, peers: dict) -> None:
    for (name, target), port in zip(peers.items(), ports, strict=True):
        target(rank, world_size, port, _Tagged(results, name))


def run_peers_in_turn(
    peers: dict, world_size: int = 2, timeout_s: float = 300
) -> dict[str, list[dict]]:
    """Each ``name: target`` of ``peers`` (as ``run_ranks`` takes them) in turn in one set of
    ``world_size`` spawned processes, each on a process group of its own (``megatron_rank``
    tears its groups down): name -> its reports sorted by ``"rank"``. For peers whose
    subject is a layout, not a process start (an interpreter importing torch and Megatron
    costs seconds). A rank that exits early fails at once, not at the timeout."""
    import queue
    import time

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = [free_loopback_port() for _ in peers]
    processes = [
        context.Process(target=_peers_in_turn, args=(rank, world_size, ports, results, peers))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    reports: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(reports) < world_size * len(peers):
        assert time.monotonic() < deadline, f"{len(reports)} reports in {timeout_s} s"
        try:
            reports.append(results.get(timeout=1))
        except queue.Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            assert not failed, f"a rank exited with {failed} after {len(reports)} reports"
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0, f"rank exited with {process.exitcode}"
    return {
        name: sorted((r for r in reports if r["peer"] == name), key=lambda r: r["rank"])
        for name in peers
    }


@contextlib.contextmanager
def megatron_rank(rank: int, world_size: int, port: int, settings, backend: str = "gloo"):
    """This process as one rank of a Megatron run: default group and Megatron's parallel
    state from ``settings`` (a ``MegatronSettings``), both torn down after. On CPU
    (``gloo``) ``torch.cuda.current_device`` answers "cpu": megatron-core allocates some
    buffers there (the one stand-in of these peers)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from relax_hpc.trainer.megatron.model import initialize_model_parallel

    warnings.simplefilter("ignore")
    if backend == "gloo":
        torch.set_num_threads(1)
        torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        initialize_model_parallel(settings)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
