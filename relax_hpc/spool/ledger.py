"""The consumption ledger: which groups of which claimed shards each step consumed.

Pure bookkeeping (no I/O); ``SpoolReader`` does the renames and reads and keeps the ledger
in the trainer's checkpoint. The exactly-once argument, in the ledger's terms:

* The stream is the claimed shards in claim order (``c<claim seq>-<name>``), each read
  group by group. A cursor per shard counts groups *taken* (handed out, or dropped as
  stale/duplicate) and *committed* (taken by steps <= ``step``).
* ``commit_step(step)`` makes everything taken since the previous commit part of ``step``.
  ``state()`` holds committed positions only, so a checkpoint of step N describes exactly
  the groups steps <= N consumed; groups taken after N are absent and are taken again
  after a resume, in the same order (claim order is on disk, in the names).
* A shard whose last group was committed at step s is *done at s*. It may be deleted only
  once a checkpoint of a step >= s is complete (``collectable``). Until then it stays in
  ``claimed/``; a resume from an older checkpoint finds it and re-reads the groups that
  checkpoint does not cover. A resume from the checkpoint that covers it finds it marked
  done and deletes it (the crash window between "checkpoint complete" and "deleted").
* Quarantine is an event, counted at once (``record_quarantine``) and remembered by name
  in the state, so a resume recounts nothing; the reader also counts, on resume, every
  shard it finds in ``quarantine/`` that the loaded state does not name (quarantined
  after that checkpoint, by an incarnation that then crashed): ``num_quarantined_shards``
  and ``num_lost_groups`` survive a consumer crash.
* A group dropped as stale by step s is a *pending redo* from s on (``record_redo``):
  the reader asks for it at once (``spool.redo``), and again after a resume from any
  checkpoint that holds it; it is settled (forgotten) once a checkpoint of a step >= s is
  complete, because the request is durable by then. A drop after the checkpoint is
  replayed by the resumed steps with the same decision, hence the same request.
* Sample ids (64-bit BLAKE2b keys) of every delivered or stale-dropped group are remembered, so a sample
  republished by a restarted rollout worker, or a shard requeued from quarantine, is
  dropped as a duplicate and never delivered twice. Memory: ~70 bytes per sample in RAM,
  8 in the checkpoint. A key collision (p ~ n^2 / 2^65) would drop a group, never
  train one twice.

Must not: touch the filesystem or know about HDF5.
"""

from __future__ import annotations

import base64
import copy
import hashlib
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax_hpc.spool.errors import SpoolError

STATE_FORMAT = 1
DELIVERED, STALE, DUPLICATE = "delivered", "stale", "duplicate"
OUTCOMES = (DELIVERED, STALE, DUPLICATE)


def sample_key(sample_id: str) -> int:
    """A 64-bit key of a sample id, for the seen-set."""
    digest = hashlib.blake2b(sample_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _pack_keys(keys: Iterable[int]) -> str:
    array = np.fromiter(keys, dtype=np.uint64)
    array.sort()
    return base64.b64encode(array.astype("<u8").tobytes()).decode("ascii")


def _unpack_keys(text: str) -> set[int]:
    return set(np.frombuffer(base64.b64decode(text), dtype="<u8").tolist())


@dataclass
class ShardCursor:
    name: str  # the claimed name, c<claim seq>-<shard name>
    num_groups: int
    committed: int = 0  # groups consumed by steps <= Ledger.step
    taken: int = 0  # groups handed out or dropped so far; >= committed
    done_step: int = -1  # the step that committed the last group; -1 while not done

    @property
    def done(self) -> bool:
        return self.done_step >= 0


class Ledger:
    def __init__(self, keep_steps: int = 1000) -> None:
        self.step = 0  # the last committed step
        self.checkpointed_step = 0  # the last step whose checkpoint is complete
        self.next_claim_seq = 0
        self.counters: Counter[str] = Counter()  # committed; events (claims, quarantine) at once
        self._cursors: dict[str, ShardCursor] = {}  # in claim order
        self._seen: set[int] = set()
        self._quarantined: set[str] = set()  # names counted in num_quarantined_shards
        self._step_seen: set[int] = set()
        self._step_counters: Counter[str] = Counter()
        self._step_ranges: list[list] = []  # [claimed name, first group, end group]
        self._step_redos: list[list[int]] = []  # [group, attempt, min policy version]
        self._pending_redos: list[list[int]] = []  # the same + the step that dropped it
        self._records: deque[dict] = deque(maxlen=keep_steps)
        self._batch_snapshot: tuple | None = None

    # --- the stream ------------------------------------------------------------------------
    def add_shard(self, name: str, num_groups: int) -> ShardCursor:
        assert name not in self._cursors, name
        cursor = ShardCursor(name, num_groups)
        in_order = not self._cursors or name > next(reversed(self._cursors))
        self._cursors[name] = cursor
        if not in_order:
            self._cursors = dict(sorted(self._cursors.items()))
        return cursor

    def cursors(self) -> list[ShardCursor]:
        return list(self._cursors.values())

    def head(self) -> ShardCursor | None:
        """The first shard with groups not yet taken, in claim order."""
        return next((c for c in self._cursors.values() if c.taken < c.num_groups), None)

    def num_untaken_groups(self) -> int:
        return sum(c.num_groups - c.taken for c in self._cursors.values())

    def num_seen(self, keys: Iterable[int]) -> int:
        return sum(1 for k in keys if k in self._seen or k in self._step_seen)

    def take(self, name: str, keys: list[int], outcome: str) -> None:
        """Record that the head shard's next group (sample ``keys``) was ``outcome``."""
        assert outcome in OUTCOMES, outcome
        cursor = self.head()
        assert cursor is not None and cursor.name == name, (name, cursor)
        index = cursor.taken
        cursor.taken += 1
        last = self._step_ranges[-1] if self._step_ranges else None
        if last is not None and last[0] == name and last[2] == index:
            last[2] += 1
        else:
            self._step_ranges.append([name, index, index + 1])
        if outcome in (DELIVERED, STALE):
            # A stale group's redo has new ids; a later copy of the old ones (a taken-over
            # chunk regenerated fresh) must not be trained beside the redo.
            self._step_seen.update(keys)
        self._step_counters[f"num_{outcome}_groups"] += 1
        self._step_counters[f"num_{outcome}_samples"] += len(keys)

    def count(self, counter: str, num: int = 1) -> None:
        """Add to a counter with the current step (rolled back with its batch)."""
        self._step_counters[counter] += num

    def record_redo(self, group: int, attempt: int, min_policy_version: int) -> None:
        """The group just taken as stale is to be generated again (attempt ``attempt``)."""
        self._step_redos.append([group, attempt, min_policy_version])
        self._step_counters["num_redo_requested_groups"] += 1

    def pending_redos(self, max_step: int | None = None) -> list[tuple[int, int, int]]:
        """(group, attempt, min policy version) of committed drops not yet settled."""
        return [
            (g, a, v) for g, a, v, s in self._pending_redos if max_step is None or s <= max_step
        ]

    def settle_redos(self, checkpoint_step: int) -> None:
        """Forget drops a complete checkpoint covers (their requests are durable)."""
        self._pending_redos = [r for r in self._pending_redos if r[3] > checkpoint_step]

    # --- batches: all or nothing --------------------------------------------------------------
    def begin_batch(self) -> None:
        assert self._batch_snapshot is None, "batch already open"
        takens = {name: c.taken for name, c in self._cursors.items()}
        self._batch_snapshot = (
            takens,
            set(self._step_seen),
            Counter(self._step_counters),
            copy.deepcopy(self._step_ranges),
            len(self._step_redos),
        )

    def rollback_batch(self) -> None:
        assert self._batch_snapshot is not None, "no batch open"
        takens, self._step_seen, self._step_counters, self._step_ranges, redos = (
            self._batch_snapshot
        )
        del self._step_redos[redos:]
        for name, cursor in self._cursors.items():
            cursor.taken = takens.get(name, 0)
        self._batch_snapshot = None

    def commit_batch(self) -> None:
        assert self._batch_snapshot is not None, "no batch open"
        self._batch_snapshot = None

    # --- steps and checkpoints -----------------------------------------------------------------
    def commit_step(self, step: int) -> dict:
        """Everything taken since the last commit was consumed by ``step``; its record."""
        if step <= self.step:
            raise ValueError(f"step {step} must be greater than the last consumed step {self.step}")
        assert self._batch_snapshot is None, "commit_step inside a batch"
        for cursor in self._cursors.values():
            cursor.committed = cursor.taken
            if cursor.committed == cursor.num_groups and not cursor.done:
                cursor.done_step = step
        self._seen |= self._step_seen
        self._step_seen = set()
        record = {"step": step, "groups": self._step_ranges, **self._step_counters}
        self.counters.update(self._step_counters)
        self._step_counters = Counter()
        self._step_ranges = []
        self._pending_redos.extend([*r, step] for r in self._step_redos)
        self._step_redos = []
        self._records.append(record)
        self.step = step
        return record

    def collectable(self, checkpoint_step: int) -> list[str]:
        """Shards done at or before ``checkpoint_step``: safe to delete once it is complete."""
        return [c.name for c in self._cursors.values() if c.done and c.done_step <= checkpoint_step]

    def forget(self, name: str) -> None:
        """Drop a shard from the stream (deleted after a checkpoint, quarantined, or missing)."""
        del self._cursors[name]

    def record_quarantine(self, name: str, num_lost_groups: int) -> bool:
        """Count shard ``name`` as quarantined (once), losing ``num_lost_groups`` groups;
        drops it from the stream. False when it was counted already."""
        self._cursors.pop(name, None)
        if name in self._quarantined:
            return False
        self._quarantined.add(name)
        self.counters["num_quarantined_shards"] += 1
        self.counters["num_lost_groups"] += num_lost_groups
        return True

    def is_quarantine_counted(self, name: str) -> bool:
        return name in self._quarantined

    def records(self) -> list[dict]:
        return list(self._records)

    # --- checkpoint state ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The committed view: what steps <= ``step`` consumed. JSON-serialisable."""
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "checkpointed_step": self.checkpointed_step,
            "next_claim_seq": self.next_claim_seq,
            "shards": [
                [c.name, c.num_groups, c.committed, c.done_step]
                for c in self._cursors.values()
                if c.committed > 0
            ],
            "counters": dict(sorted(self.counters.items())),
            "records": list(self._records),
            "seen_sample_keys": _pack_keys(self._seen),
            "quarantined_shards": sorted(self._quarantined),
            "pending_redos": [list(r) for r in self._pending_redos],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], keep_steps: int = 1000) -> Ledger:
        """The ledger of a checkpoint; its step counts as checkpointed (it was loaded)."""
        if state.get("format") != STATE_FORMAT:
            raise SpoolError(
                f"spool ledger state format {state.get('format')!r} is not {STATE_FORMAT}; "
                "the checkpoint was written by a different relax_hpc version"
            )
        ledger = cls(keep_steps)
        ledger.step = ledger.checkpointed_step = int(state["step"])
        ledger.next_claim_seq = int(state["next_claim_seq"])
        ledger.counters = Counter(state["counters"])
        ledger._records.extend(state["records"])
        ledger._seen = _unpack_keys(state["seen_sample_keys"])
        ledger._quarantined = set(state.get("quarantined_shards", []))  # absent in older states
        ledger._pending_redos = [list(r) for r in state.get("pending_redos", [])]  # likewise
        for name, num_groups, committed, done_step in sorted(state["shards"]):
            ledger.add_shard(name, num_groups)
            cursor = ledger._cursors[name]
            cursor.committed = cursor.taken = committed
            cursor.done_step = done_step
        return ledger
