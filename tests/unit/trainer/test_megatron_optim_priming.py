"""A fresh distributed optimizer on torch's Adam must give Megatron a state to load into.

The first GPU run found that a resume crashed in ``DistributedOptimizer.state_dict`` before
it read anything: without Transformer Engine or Apex it takes one ``step`` from every
parameter's state, and a fresh torch Adam has none. Megatron's wrapper needs CUDA to be
built (its gradient buffers live on the device), so here its own ``state_dict`` runs unbound
over a stand-in holding a real AdamW: the code under test and Megatron's code are real.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from relax_hpc.trainer.megatron.optim import prime_fresh_torch_adam

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
    pytest.mark.skipif(
        distrib_optimizer.HAVE_APEX_OR_TE, reason="Apex or TE installed: Megatron's other path"
    ),
]


def fresh_distributed_optimizer(optimizer_class=torch.optim.AdamW) -> SimpleNamespace:
    shards = [torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(3, 4))]
    return SimpleNamespace(optimizer=optimizer_class(shards, lr=1e-3), grad_scaler=None)


def test_a_fresh_torch_adam_is_what_megatron_cannot_build_a_load_state_for():
    with pytest.raises(AssertionError):
        DistributedOptimizer.state_dict(fresh_distributed_optimizer())


def test_a_primed_fresh_adam_gives_megatron_step_zero_and_zero_moments():
    optimizer = fresh_distributed_optimizer()
    params = [p.detach().clone() for p in optimizer.optimizer.param_groups[0]["params"]]
    prime_fresh_torch_adam(SimpleNamespace(chained_optimizers=[optimizer]))
    state_dict = DistributedOptimizer.state_dict(optimizer)
    assert [g["step"] for g in state_dict["optimizer"]["param_groups"]] == [0.0]
    for param, before in zip(optimizer.optimizer.param_groups[0]["params"], params, strict=True):
        state = optimizer.optimizer.state[param]
        assert torch.equal(param, before)  # priming steps nothing
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        assert state["exp_avg"].shape == param.shape


def test_a_stepped_adam_keeps_its_state():
    optimizer = fresh_distributed_optimizer()
    param = optimizer.optimizer.param_groups[0]["params"][0]
    param.grad = torch.ones_like(param)
    optimizer.optimizer.step()
    moments = optimizer.optimizer.state[param]["exp_avg"].clone()
    prime_fresh_torch_adam(optimizer)
    assert torch.equal(optimizer.optimizer.state[param]["exp_avg"], moments)
    assert float(optimizer.optimizer.state[param]["step"]) == 1.0


def test_other_optimizers_are_left_alone():
    optimizer = fresh_distributed_optimizer(torch.optim.SGD)
    prime_fresh_torch_adam(optimizer)
    assert not optimizer.optimizer.state
