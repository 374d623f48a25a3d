"""Which rollout worker generates which prompt groups: claims in the run directory.

Batch ``k`` (consumed by training step ``k + 1``) is groups ``[k * P, (k + 1) * P)``, ``P``
prompts per step. It is cut into *chunks* of ``C`` groups (the last one shorter), and a
worker generates a chunk only after claiming it. Claims replace the fixed ``g % W`` split,
so any number of workers, joining or leaving, consume the prompt stream once:

    rollout_assignment/
      layout.json                   P and C, fixed by the run's first worker
      b<batch:08d>/j<chunk:04d>.claim   {"worker", "incarnation", "time"}: being generated
      b<batch:08d>/j<chunk:04d>.done    published to the spool
      workers/<worker>.json         heartbeats (``WorkerHeartbeat``)
      floor/<batch:08d>             every chunk of every earlier batch is done

* A claim is an exclusive create (``paths.exclusive_create_json``): one winner per chunk.
* A chunk is *done* once its shard is published; the done marker is written before the
  claim is removed, so a scan never sees a published chunk as open.
* A claim is taken over when its holder's heartbeat is older than ``lease_s`` (the worker
  died or hangs), or when it is the holder's own from an earlier incarnation (the same
  worker restarted): the claim is renamed away first, and only the one rename that wins
  may claim again. Regenerated groups have the same sample ids (``g/j``), so if the old
  holder did publish after all, the spool drops the copy as a duplicate: a takeover costs
  at most repeated work, never a sample trained twice or a prompt skipped.
* When a batch and all below it are done, the worker that finished it creates
  ``floor/<next>`` (exclusively, so one of them) and removes the batch's folder: the
  folder stays small over a long run, and a scan starts at the floor.

Redos come first: a group the trainer dropped as stale is asked for again in
``spool/redo/`` (``spool.redo``). A worker claims a redo before any chunk, the same way
(``<key>.claim``, exclusive; taken over after the lease), generates it with weights at
least as new as the trainer's when it dropped the group, publishes it under the redo's own
sample ids and marks it ``<key>.done``.

Durability: nothing here is fsynced (8 fsyncs per chunk once, then 2, now none: the
claim's fsync alone held the rollout's critical path ~2 ms a step), because exactly-once
does not rest on the markers' durability:

* nothing is trained twice whatever the markers say: the trainer's ledger keeps every
  delivered sample id in its checkpoint and drops a republished one as a duplicate;
* nothing is skipped: a chunk's shard is durable in the spool (fsynced, renamed into
  ``ready/``, ``ready/`` fsynced) before its done marker is created, and a floor is
  created only once every done marker below it exists; so any done marker or floor that
  exists, before or after a crash, seen from any node, stands for durable shards.

A node crash can only *lose* markers or their content: a lost done marker or floor makes
finished chunks look open (generated again, dropped as duplicates), a lost claim frees its
chunk (claimed again). A claim whose name survived but whose content did not (empty or
not JSON: it names no holder) is taken over once its file is older than ``lease_s``, as a
dead holder's would be; a floor's content is never read. That costs repeated work, bounded
by what the crashed node's page cache held; NFS and Lustre make link, rename and unlink
durable on the server before they return.

The data position is this folder, not a worker's progress: it lives on the shared run
directory beside the spool and survives any worker's crash. Must not: read shards or
know about engines.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.paths import atomic_write_json, exclusive_create_json, read_json
from relax_hpc.spool.redo import open_requests, redo_key

_BATCH_DIR = re.compile(r"^b(\d{8})$")
_FLOOR = re.compile(r"^\d{8}$")


@dataclass(frozen=True)
class Chunk:
    batch: int
    index: int
    groups: tuple[int, ...]
    attempt: int = 0  # > 0: a redo of one stale group (``spool.redo``)
    min_policy_version: int = 0  # a redo's weights must be at least this new

    @property
    def is_redo(self) -> bool:
        return self.attempt > 0

    @property
    def name(self) -> str:
        return redo_key(self.groups[0], self.attempt) if self.is_redo else f"j{self.index:04d}"


class AssignmentLayoutError(ValueError):
    """The run's assignment folder was made with another prompts-per-step or chunk size."""


class GroupAssignment:
    """One worker's view of the shared claims (one instance per worker process)."""

    def __init__(
        self,
        root: Path,
        worker: str,
        prompts_per_step: int,
        groups_per_chunk: int,
        lease_s: float,
        clock: Callable[[], float] = time.time,
        redo_dir: Path | None = None,  # the spool's redo requests; None: none are taken
    ) -> None:
        self.root = Path(root)
        self.redo_dir = None if redo_dir is None else Path(redo_dir)
        self.worker = worker
        self.incarnation = secrets.token_hex(6)
        self.lease_s = lease_s
        self.clock = clock
        self.prompts_per_step, self.groups_per_chunk = self._layout(
            prompts_per_step, groups_per_chunk
        )
        self.chunks_per_batch = -(-self.prompts_per_step // self.groups_per_chunk)

    # --- claiming --------------------------------------------------------------------------
    def lowest_open_batch(self) -> int:
        """The first batch with a chunk nobody is generating (the next to wait weights for)."""
        batch = self.floor()
        while not any(self._is_open(batch, j) for j in range(self.chunks_per_batch)):
            batch += 1
        return batch

    def claim(self, max_batch: int) -> Chunk | None:
        """Claim the first open chunk of a batch ``<= max_batch``, or None when all are taken."""
        batch = self.floor()
        while batch <= max_batch:
            for index in range(self.chunks_per_batch):
                if self._is_open(batch, index) and self._try_claim(batch, index):
                    return self._chunk(batch, index)
            batch += 1
        return None

    def claim_redo(self) -> Chunk | None:
        """Claim the first redo nobody is generating, or None."""
        if self.redo_dir is None:
            return None
        for request in open_requests(self.redo_dir):
            claim = self.redo_dir / f"{request.key}.claim"
            done = self.redo_dir / f"{request.key}.done"
            if done.exists() or (claim.exists() and not self._claim_expired(claim)):
                continue
            if self._take(claim, done, collected=lambda: False):
                batch = request.group // self.prompts_per_step
                return Chunk(
                    batch, -1, (request.group,), request.attempt, request.min_policy_version
                )
        return None

    def complete(self, chunk: Chunk) -> None:
        """The chunk's groups are published: mark it done, release it, maybe raise the floor."""
        if chunk.is_redo:
            self._complete_redo(chunk)
            return
        # Below the floor: this worker hung past its lease, another took the chunk over and
        # the batch was collected. What it just published is a duplicate that the spool
        # drops; there is nothing left to mark (and no folder to write into: a collection
        # racing the write below ends in FileNotFoundError, the same case).
        if chunk.batch < self.floor():
            return
        folder = self._batch_dir(chunk.batch)
        try:
            atomic_write_json(folder / f"{chunk.name}.done", self._stamp(), durable=False)
        except FileNotFoundError:
            return
        (folder / f"{chunk.name}.claim").unlink(missing_ok=True)
        self._raise_floor()

    def release(self, chunk: Chunk) -> None:
        """Give a claimed chunk back ungenerated (a worker draining or stopping)."""
        path = self._claim_path(chunk)
        if self._holder(path) == (self.worker, self.incarnation):
            path.unlink(missing_ok=True)

    def floor(self) -> int:
        return floor_of(self.root)

    # --- status ----------------------------------------------------------------------------
    def holders(self) -> dict[str, list[str]]:
        return chunk_holders(self.root)

    # --- internals -------------------------------------------------------------------------
    def _layout(self, prompts_per_step: int, groups_per_chunk: int) -> tuple[int, int]:
        wanted = {"prompts_per_step": prompts_per_step, "groups_per_chunk": groups_per_chunk}
        self.root.mkdir(parents=True, exist_ok=True)
        exclusive_create_json(self.root / "layout.json", wanted)
        found = read_json(self.root / "layout.json")
        if found["prompts_per_step"] != prompts_per_step:
            raise AssignmentLayoutError(
                f"{self.root} was made for rollout.prompts_per_step="
                f"{found['prompts_per_step']}, this run has {prompts_per_step}: a run's "
                "batches cannot change size; start a new run_dir for a new batch size"
            )
        return found["prompts_per_step"], found["groups_per_chunk"]

    def _chunk(self, batch: int, index: int) -> Chunk:
        start = batch * self.prompts_per_step + index * self.groups_per_chunk
        stop = min(start + self.groups_per_chunk, (batch + 1) * self.prompts_per_step)
        return Chunk(batch, index, tuple(range(start, stop)))

    def _complete_redo(self, chunk: Chunk) -> None:
        assert self.redo_dir is not None
        atomic_write_json(self.redo_dir / f"{chunk.name}.done", self._stamp(), durable=False)
        self._claim_path(chunk).unlink(missing_ok=True)

    def _claim_path(self, chunk: Chunk) -> Path:
        if chunk.is_redo:
            assert self.redo_dir is not None
            return self.redo_dir / f"{chunk.name}.claim"
        return self._batch_dir(chunk.batch) / f"{chunk.name}.claim"

    def _batch_dir(self, batch: int) -> Path:
        return self.root / f"b{batch:08d}"

    def _stamp(self) -> dict[str, Any]:
        return {"worker": self.worker, "incarnation": self.incarnation, "time": self.clock()}

    def _is_open(self, batch: int, index: int) -> bool:
        if batch < self.floor():
            return False
        folder = self._batch_dir(batch)
        if (folder / f"j{index:04d}.done").exists():
            return False
        claim = folder / f"j{index:04d}.claim"
        return not claim.exists() or self._claim_expired(claim)

    def _claim_expired(self, claim: Path) -> bool:
        holder = self._holder(claim)
        if holder is None:
            return self._content_lost(claim)
        worker, incarnation = holder
        if worker == self.worker:
            return incarnation != self.incarnation  # mine, from before a restart
        return not heartbeat_alive(self.root, worker, self.lease_s, self.clock())

    def _content_lost(self, claim: Path) -> bool:
        """A claim that names no holder: vanished under us (completed or taken over: look
        again later), or left by a crash that kept its name but lost its unflushed content
        (expired once older than a lease: its content was written before its name)."""
        try:
            age_s = self.clock() - claim.stat().st_mtime
        except FileNotFoundError:
            return False
        return age_s > self.lease_s

    def _holder(self, claim: Path) -> tuple[str, str] | None:
        found = read_json(claim, default=None)
        if not isinstance(found, dict):
            return None
        worker, incarnation = found.get("worker"), found.get("incarnation")
        if not isinstance(worker, str) or not isinstance(incarnation, str):
            return None
        return worker, incarnation

    def _try_claim(self, batch: int, index: int) -> bool:
        folder = self._batch_dir(batch)
        return self._take(
            folder / f"j{index:04d}.claim",
            folder / f"j{index:04d}.done",
            collected=lambda: batch < self.floor(),
        )

    def _take(self, claim: Path, done: Path, collected: Callable[[], bool]) -> bool:
        """Create ``claim``, taking over an expired one; False if another won or it is done."""
        if claim.exists() and not self._take_over(claim):
            return False
        if collected():
            return False  # done and collected meanwhile
        try:
            claim.parent.mkdir(parents=True, exist_ok=True)
            won = exclusive_create_json(claim, self._stamp(), durable=False)
        except (FileNotFoundError, FileExistsError):
            # The folder was collected under a new floor (FileExistsError: mkdir found it,
            # then it was gone before mkdir could see it was a folder).
            return False
        if won and (collected() or done.exists()):
            claim.unlink(missing_ok=True)  # done meanwhile: nothing to generate
            return False
        return won

    def _take_over(self, claim: Path) -> bool:
        """Move an expired ``claim`` out of the way; False if it is not (or no longer) one.

        Judged again here, not only when the chunk looked open: another worker may have
        claimed it since (a live claim then). Only the process whose rename wins goes on; a
        loser sees ENOENT. A rename that moved a live claim after all (created between the
        judgement and the rename) puts it back."""
        if not self._claim_expired(claim):
            return False
        moved = claim.with_name(f"{claim.stem}.expired.{self.incarnation}")
        try:
            os.rename(claim, moved)
        except FileNotFoundError:
            return False
        try:
            if self._claim_expired(moved):
                return True
            os.link(moved, claim)  # fails if yet another claim exists: that one holds it
        except FileExistsError:
            pass
        finally:
            moved.unlink(missing_ok=True)
        return False

    def _batch_done(self, batch: int) -> bool:
        folder = self._batch_dir(batch)
        return all((folder / f"j{j:04d}.done").exists() for j in range(self.chunks_per_batch))

    def _raise_floor(self) -> None:
        floor = self.floor()
        while self._batch_done(floor):
            raised = exclusive_create_json(
                self.root / "floor" / f"{floor + 1:08d}", {}, durable=False
            )
            if not raised:
                return  # another worker raised it and collects
            shutil.rmtree(self._batch_dir(floor), ignore_errors=True)
            (self.root / "floor" / f"{floor:08d}").unlink(missing_ok=True)
            floor += 1


def floor_of(root: Path) -> int:
    """Every chunk of every batch below this one is done."""
    entries = [int(n) for n in _names(Path(root) / "floor") if _FLOOR.match(n)]
    return max(entries, default=0)


def chunk_holders(root: Path) -> dict[str, list[str]]:
    """Worker -> the chunks it holds (``b<batch>/j<chunk>``); reads only (status, tests)."""
    return {worker: [chunk for chunk, _ in claims] for worker, claims in held_claims(root).items()}


def held_claims(root: Path) -> dict[str, list[tuple[str, float]]]:
    """Worker -> (chunk, wall-clock time it was claimed) of each chunk it holds; reads only
    (status, the run watcher's stall diagnosis)."""
    root = Path(root)
    held: dict[str, list[tuple[str, float]]] = {}
    batches = sorted(int(m.group(1)) for n in _names(root) if (m := _BATCH_DIR.match(n)))
    for batch in (b for b in batches if b >= floor_of(root)):
        folder = root / f"b{batch:08d}"
        for name in sorted(_names(folder)):
            if name.endswith(".claim"):
                claim = read_json(folder / name, default=None)
                if not isinstance(claim, dict):  # its content lost in a crash (see above)
                    claim = {}
                chunk = (f"b{batch:08d}/{name[:-6]}", float(claim.get("time", 0.0)))
                worker = claim.get("worker")
                held.setdefault(worker if isinstance(worker, str) else "?", []).append(chunk)
    return held


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


# --- heartbeats ------------------------------------------------------------------------------
def worker_name(rank: int, pool: str | None = None) -> str:
    """``r<rank>`` in the run's own rollout step, ``<pool>.<rank>`` in an extra pool."""
    return f"r{rank}" if pool is None else f"{pool}.{rank}"


def heartbeat_path(root: Path, worker: str) -> Path:
    return Path(root) / "workers" / f"{worker}.json"


def heartbeat_alive(root: Path, worker: str, lease_s: float, now: float) -> bool:
    beat = read_json(heartbeat_path(root, worker), default=None)
    return beat is not None and not beat.get("left") and now - beat["time"] <= lease_s


class WorkerHeartbeat:
    """A thread that rewrites ``workers/<worker>.json`` every ``interval_s``.

    A thread, not the loop, so a long generation is not taken for a hang; a stopped
    (SIGSTOP) or dead process stops beating, and its claims expire after the lease.
    ``details`` (policy version, samples) is read at each beat, for ``status``.
    """

    def __init__(
        self,
        root: Path,
        worker: str,
        interval_s: float,
        details: Callable[[], Mapping[str, Any]] = dict,
    ) -> None:
        self.path = heartbeat_path(root, worker)
        self.interval_s = interval_s
        self.details = details
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> WorkerHeartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self, left: bool = False) -> None:
        record = {"time": time.time(), "pid": os.getpid(), "left": left, **self.details()}
        # No fsync: a beat lost in a crash (or a file left empty) reads as an older or no
        # beat, so the worker's claims expire sooner, never later; the worker is gone then.
        atomic_write_json(self.path, record, durable=False)

    def stop(self) -> None:
        """Stop beating and say so: the worker's claims are free at once, not after a lease."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 1)
        self.beat(left=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()
