"""Two FSDP2 trainer ranks (separate processes, gloo) train the tiny Qwen3-VL policy on
image prompts: the decoder layers are sharded units, the vision tower trains in the root
unit, and the step's weights equal a single process's (losses are normalised by global
counts, so the number of ranks does not change the update). A rank whose micro-batch holds
no image (its tower gets no gradient) does not break the other's reduce-scatter: without
``set_reduce_scatter_unused_params`` gloo aborted on the size mismatch."""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from media_engine_peer import VL, sampled_groups
from test_checkpoint_dist import free_port

from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.trainer.backend import HFNetworks, make_backend
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.group import leave_group_and_exit
from relax_hpc.trainer.torch_backend import decoder_layers
from relax_hpc.trainer.update import prepare_step, update_policy

WORLD_SIZE = 2
GRPO = resolve(AlgoConfig(name="grpo"))
# Adam's first step moves every weight by ~lr; a smaller lr keeps the rounding noise of
# near-zero gradients (summed in another order over ranks) under the tolerance.
LR = 1e-3


def one_step(rank: int, world_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """The policy's full weights after one GRPO step on this rank's share of the batch, and
    how many of its decoder layers are FSDP2 units."""
    from torch.distributed.fsdp import FSDPModule

    model, processor = build_media_policy(VL, seed=1)
    batch = collate(sampled_groups(model, processor), processor.tokenizer.pad_token_id, processor)
    trainer = TrainerConfig(lr=LR, micro_batch_tokens=10**6)
    backend = make_backend(trainer, torch.device("cpu"), torch.float32, rank, world_size)
    nets = backend.build_networks(HFNetworks(policy=model, processor=processor))
    tensors = prepare_step(GRPO, batch, nets, 1.0)
    update_policy(GRPO, batch, tensors, nets.policy, (1, 1, rank, world_size), 1.0)
    units = sum(isinstance(m, FSDPModule) for m in decoder_layers(nets.policy.network))
    return {k: v.clone() for k, v in backend.policy_weights().items()}, units


def rank_main(rank: int, port: int, results) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    weights, units = one_step(rank, WORLD_SIZE)
    if rank == 0:
        results["weights"], results["units"] = weights, units
    leave_group_and_exit(0)  # as the trainer leaves (trainer/group.py)


def test_two_fsdp2_ranks_train_a_vl_policy_as_one_process_does():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    manager = mp.Manager()
    results = manager.dict()
    context = mp.spawn(rank_main, args=(free_port(), results), nprocs=WORLD_SIZE, join=False)
    deadline = time.monotonic() + 180
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "ranks did not finish within 180 s"
    sharded, units = results["weights"], results["units"]
    assert units == 2  # both decoder layers of the tiny model (model.language_model.layers)
    single, unsharded = one_step(0, 1)
    assert unsharded == 0
    initial = build_media_policy(VL, seed=1)[0].state_dict()
    assert sharded.keys() == single.keys() == initial.keys()
    tower = [n for n in single if n.startswith("model.visual.")]
    assert any(not torch.equal(sharded[n], initial[n]) for n in tower)
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, atol=2e-6, rtol=1e-4, msg=name)


def uneven_rank_main(rank: int, port: int, results) -> None:
    """Rank 0 trains on image rows, rank 1 on text-only rows of the same VL policy."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    model, processor = build_media_policy(VL, seed=1)
    groups = sampled_groups(model, processor)
    if rank == 1:
        for group in groups:
            for sample in group:
                sample.media = None  # (its prompt ids keep their pads: no forward of them)
    batch = collate(groups, processor.tokenizer.pad_token_id, processor)
    trainer = TrainerConfig(lr=LR, micro_batch_tokens=10**6)
    backend = make_backend(trainer, torch.device("cpu"), torch.float32, rank, WORLD_SIZE)
    nets = backend.build_networks(HFNetworks(policy=model, processor=processor))
    micro = batch.select([0, 1]) if rank == 0 else text_rows(batch, processor)
    logprobs, _ = nets.policy.token_logprobs(micro, 1.0, with_entropy=False)
    (logprobs * micro.response_mask_BT).sum().neg().backward()
    nets.policy.optimizer_step()
    weights = backend.policy_weights()
    if rank == 0:
        results["weights"] = {k: v.clone() for k, v in weights.items()}
    leave_group_and_exit(0)  # as the trainer leaves (trainer/group.py)


def text_rows(batch, processor):
    """Two rows holding only text: the response tokens after a plain-text prompt."""
    rows = batch.select([0, 1])
    pads = set(processor.media_token_ids)
    keep = [
        [t for t in row.tolist() if t not in pads] for row in rows.input_ids_BL
    ]  # drop the image's pads: a text-only prompt of the same task
    length = max(map(len, keep))
    ids = torch.full((2, length), processor.tokenizer.pad_token_id)
    for i, row in enumerate(keep):
        ids[i, : len(row)] = torch.tensor(row)
    dropped = rows.input_ids_BL.shape[1] - length
    return dataclasses.replace(
        rows,
        input_ids_BL=ids,
        attention_mask_BL=rows.attention_mask_BL[:, dropped:],
        prompt_len_B=rows.prompt_len_B - dropped,
        media=None,
    )


def test_fsdp2_ranks_with_and_without_images_in_a_micro_batch_do_not_hang():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    manager = mp.Manager()
    results = manager.dict()
    context = mp.spawn(uneven_rank_main, args=(free_port(), results), nprocs=WORLD_SIZE, join=False)
    deadline = time.monotonic() + 180
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "ranks did not finish within 180 s"
    weights = results["weights"]
    initial = build_media_policy(VL, seed=1)[0].state_dict()
    tower = [n for n in initial if n.startswith("model.visual.")]
    assert any(not torch.equal(weights[n], initial[n]) for n in tower)
