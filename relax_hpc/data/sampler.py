"""Deterministic, resumable prompt order: epochs of seeded permutations of a dataset.

Epoch ``e`` visits the dataset in the order ``randperm(len, seed=hash(seed, e))`` (or in
index order without shuffling). The whole state is ``(seed, epoch, position)``: a sampler
restored from ``state_dict()`` continues with exactly the prompts the original would have
drawn next. Permutations are recomputed from the seed, never stored.

A dataset may answer None for a row it skipped (an unusable image, ``data.media_prompts``):
the sampler draws the next position instead (the stream stays a pure function of the
state; the rollout loop, which addresses group ``g`` as position ``g``, then gives that group
the next position's prompt) and counts the row in ``skipped_indices``.

Must not: tokenize, score or batch; it only decides which index comes next.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

Record = TypeVar("Record")


def epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"sampler:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class PromptSampler(Generic[Record]):
    """Yields ``(data_index, record)`` forever, epoch after epoch."""

    def __init__(self, dataset: Sequence[Record], seed: int, shuffle: bool = True) -> None:
        if len(dataset) == 0:
            raise ValueError("the prompt dataset is empty")
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # prompts of the current epoch already drawn
        self._order: list[int] | None = None  # the current epoch's permutation, cached
        self.skipped_indices: set[int] = set()  # rows the dataset answered None for

    @property
    def num_consumed(self) -> int:
        """Prompts drawn so far over all epochs: a unique, resumable id for the next group."""
        return self.epoch * len(self.dataset) + self.position

    def __iter__(self) -> Iterator[tuple[int, Record]]:
        return self

    def __next__(self) -> tuple[int, Record]:
        for _ in range(len(self.dataset)):
            if self.position == len(self.dataset):
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            index = self._epoch_order()[self.position]
            self.position += 1
            record = self.dataset[index]
            if record is not None:
                return index, record
            self.skipped_indices.add(index)
        raise ValueError(
            f"every one of the {len(self.dataset)} prompts tried was skipped (see the log "
            "for why each row was); fix the dataset's media"
        )

    def take(self, num_prompts: int) -> list[tuple[int, Record]]:
        """The next ``num_prompts`` draws (one step's prompts)."""
        return [next(self) for _ in range(num_prompts)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "shuffle": self.shuffle,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; its seed wins over the one given to ``__init__``."""
        if state["dataset_len"] != len(self.dataset):
            raise ValueError(
                f"sampler state is for a dataset of {state['dataset_len']} prompts, this one has "
                f"{len(self.dataset)}; resume with the same data or start a new run"
            )
        if not 0 <= state["position"] <= len(self.dataset):
            raise ValueError(f"sampler state position {state['position']} is out of range")
        same_order = (int(state["seed"]), bool(state["shuffle"]), int(state["epoch"])) == (
            self.seed,
            self.shuffle,
            self.epoch,
        )
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if not same_order:  # the rollout seeks to every group: keep the epoch's permutation
            self._order = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
                self._order = torch.randperm(len(self.dataset), generator=generator).tolist()
            else:
                self._order = list(range(len(self.dataset)))
        return self._order
