"""A resume is bit-identical whatever step the checkpoint was saved at, step 0 included.

torch's ``get_state_dict`` materialises an empty optimizer's state with a dummy step (lr 0,
zero grads). Saved as is, a step-0 checkpoint resumes AdamW with its step counter at 1, so
every later update uses the wrong bias correction and the weights drift from the run that
was never interrupted. Real DCP checkpoints, one process.
"""

from __future__ import annotations

import pytest
import torch

from relax_hpc.checkpoint.stateful import ModelAndOptimizer
from relax_hpc.checkpoint.store import CheckpointStore, latest_checkpoint
from relax_hpc.paths import RunPaths

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
NUM_STEPS = 4

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.5),
}


def _fresh(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    return model, OPTIMIZERS[kind](model.parameters())


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        inputs = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(inputs).pow(2).sum().backward()
        optimizer.step()


def _resumed_at(tmp_path, kind: str, stop_step: int) -> tuple[torch.nn.Module, bool]:
    """Train to ``stop_step``, checkpoint, load into a fresh process's objects, finish;
    the model and whether saving left the live optimizer as it was."""
    paths = RunPaths(tmp_path / f"run-{kind}-{stop_step}").create()
    model, optimizer = _fresh(kind)
    _train(model, optimizer, range(stop_step))
    live_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    CheckpointStore(paths, keep=1).save(stop_step, {"policy": ModelAndOptimizer(model, optimizer)})
    live_after = {id(p): s for p, s in optimizer.state.items()}
    live_kept = live_after.keys() == live_before.keys() and all(
        torch.equal(v, live_after[key][k]) for key, s in live_before.items() for k, v in s.items()
    )

    model, optimizer = _fresh(kind)
    CheckpointStore(paths, keep=1).load(
        latest_checkpoint(paths), {"policy": ModelAndOptimizer(model, optimizer)}
    )
    _train(model, optimizer, range(stop_step, NUM_STEPS))
    return model, live_kept


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stop_step", [0, 2])
def test_resume_is_bit_identical_including_before_the_first_step(tmp_path, kind, stop_step):
    reference, optimizer = _fresh(kind)
    _train(reference, optimizer, range(NUM_STEPS))
    resumed, live_kept = _resumed_at(tmp_path, kind, stop_step)
    named = zip(reference.state_dict().items(), resumed.state_dict().values(), strict=True)
    different = [name for (name, want), got in named if not torch.equal(want, got)]
    assert different == [], f"differ after a resume at step {stop_step}"
    assert live_kept, "saving the checkpoint changed the live optimizer's state"


class _WithUnused(torch.nn.Module):
    """A parameter the forward never reads (as Qwen2.5-Omni's ``audio_bos_eos_token``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, 2)
        self.unused = torch.nn.Embedding(2, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs)


def test_a_parameter_without_gradients_resumes_bit_identically(tmp_path):
    def fresh():
        torch.manual_seed(0)
        model = _WithUnused()
        return model, OPTIMIZERS["adamw"](model.parameters())

    paths = RunPaths(tmp_path / "run").create()
    model, optimizer = fresh()
    _train(model, optimizer, range(2))
    assert model.unused.weight not in optimizer.state
    CheckpointStore(paths, keep=1).save(2, {"policy": ModelAndOptimizer(model, optimizer)})
    assert model.unused.weight not in optimizer.state  # the live optimizer left as it was
    _train(model, optimizer, range(2, NUM_STEPS))

    resumed, resumed_optimizer = fresh()
    CheckpointStore(paths, keep=1).load(
        latest_checkpoint(paths), {"policy": ModelAndOptimizer(resumed, resumed_optimizer)}
    )
    assert resumed.unused.weight not in resumed_optimizer.state
    _train(resumed, resumed_optimizer, range(2, NUM_STEPS))
    for name, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
