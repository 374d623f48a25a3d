"""Adapters that make trainer state safe to round-trip through DCP.

DCP loads *in place*: it reads only the keys present in the state dict it is handed. Two
kinds of state therefore need wrapping:

- model + optimizer: ``get_state_dict`` materialises the optimizer's state with
  fully-qualified names, which also works for FSDP2-sharded models. Before the first step
  it does so by running a dummy step (lr 0, zero grads), which leaves AdamW's step counter
  at 1; ``ModelAndOptimizer`` undoes that on the live optimizer and records
  ``optimizer_stepped`` so that a resume before the first step gets an empty optimizer
  state again, exactly as the uninterrupted run holds it (else every later update uses
  the wrong bias correction and the weights differ);
- small, variable-shaped state (progress counters, the spool ledger, the data sampler,
  RNG): serialised as one opaque leaf, so that a fresh object loads whatever was saved.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModelAndOptimizer:
    """``Stateful`` view of a model and its optimizer (plain or FSDP2)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state; the live optimizer is left exactly as it was.

        The optimizer entry always has the shape of a stepped optimizer (DCP loads only the
        keys of the template, so a template without state could not receive a saved one);
        ``optimizer_stepped`` says whether that state is real or the dummy step's.
        """
        optimizers = [self.optimizer] if self.optimizer is not None else []
        stepped = self.optimizer is not None and bool(self.optimizer.state)
        model_state, optim_state = get_state_dict(self.model, optimizers)
        if self.optimizer is not None and not stepped:
            self.optimizer.state.clear()  # drop the dummy step's state from the live optimizer
        elif self.optimizer is not None:
            _fill_unstepped(self.model, model_state, optim_state)
        return {
            "model": model_state,
            "optimizer": optim_state,
            "optimizer_stepped": torch.tensor(stepped),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(
            self.model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(strict=True),
        )
        if self.optimizer is not None and not bool(state["optimizer_stepped"]):
            self.optimizer.state.clear()  # saved before the first step: no state, no step count
        elif self.optimizer is not None:
            _drop_unstepped(self.optimizer)


def _fill_unstepped(
    model: torch.nn.Module, model_state: dict[str, Any], optim_state: dict[str, Any]
) -> None:
    """Zero state with step 0 for trainable parameters the optimizer never stepped (no
    gradient yet: a tower no micro-batch has used, or a parameter the forward never reads,
    as Qwen2.5-Omni's ``audio_tower.audio_bos_eos_token``). A fresh optimizer's template
    has state for every trainable parameter (the dummy step), so a checkpoint without
    theirs could not be loaded ("Missing key in checkpoint state_dict")."""
    states = optim_state.get("state", {})
    if not states:
        return
    example = next(iter(states.values()))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    for name in sorted(trainable & set(model_state) - set(states)):
        value = model_state[name]
        states[name] = {
            key: torch.zeros_like(v) if v.dim() == 0 else torch.zeros_like(value)
            for key, v in example.items()
            if isinstance(v, torch.Tensor)
        }


def _drop_unstepped(optimizer: torch.optim.Optimizer) -> None:
    """Remove the state ``_fill_unstepped`` saved (step 0): such a parameter holds no state
    in the run that was never interrupted, and AdamW's first update from none and from a
    zero state with step 0 differ in nothing, but an optimizer without a step counter
    (SGD with momentum) does; only stepped optimizers' step-0 entries are dropped."""
    for parameter, state in list(optimizer.state.items()):
        step = state.get("step")
        if isinstance(step, torch.Tensor) and float(step) == 0.0:
            del optimizer.state[parameter]


class OpaqueState:
    """Wraps a ``Stateful`` whose state has no fixed shape; saved as one pickled leaf.

    Only the trainer's own checkpoint is unpickled, from the run directory it wrote.
    """

    def __init__(self, inner: Stateful) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return {"pickle": pickle.dumps(self.inner.state_dict(), protocol=pickle.HIGHEST_PROTOCOL)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(pickle.loads(state["pickle"]))


class RngState:
    """Python, NumPy-free torch CPU (and CUDA when present) random states of this rank."""

    def state_dict(self) -> dict[str, Any]:
        import random

        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import random

        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
