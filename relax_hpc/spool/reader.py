"""The trainer side: claim shards, hand out batches of whole groups, keep the ledger.

Exactly one ``SpoolReader`` consumes a spool: the trainer's rank 0 (it hands groups on to
the other ranks). Claiming is ``rename(ready/<name>, claimed/c<seq>-<name>)``: atomic on
NFS/Lustre/GPFS, no locks. The claims are flushed (one fsync of ``claimed/``) when
``state_dict`` is taken for a checkpoint, not at each claim: a claim that no checkpoint
records yet is one a crash may undo, and undoing it only puts the shard back in ``ready/``,
to be claimed again by the resumed run, which retrains every step after its checkpoint
anyway (either state of the rename resumes exactly-once, see ``_recover``). The trainer loop::

    groups = reader.next_batch(num_groups, policy_version)   # claims as needed, blocks
    train_step(groups)
    reader.mark_step_consumed(step)                         # commits the ledger
    if checkpointing:
        save({"spool": reader.state_dict(), ...})            # ledger of steps <= step
        reader.on_checkpoint_complete(step)                  # consumed shards deleted now

and on resume ``reader.load_state_dict(saved["spool"])`` before the first ``next_batch``.
Only the state of a *complete* checkpoint may be loaded. After it, everything consumed
after that checkpoint's step is handed out again, in the original order, and nothing
consumed up to it is handed out again (see ``ledger`` for the argument). With
``keep_consumed`` the consumed shards move to ``consumed/`` rather than being deleted,
and a resume from an older retained checkpoint also restores them.

A group dropped as stale is sent back to the prompt stream: ``mark_step_consumed`` writes
a redo request for each drop of the step (``redo``), and ``on_checkpoint_complete`` (also
run by a resume) writes again those the checkpoint holds before it forgets them.

Staleness is per group: GRPO-style advantages need every completion of a prompt, so a
group whose oldest sample is more than ``max_staleness`` versions behind the trainer's
``policy_version`` is dropped whole and counted, never silently. Duplicate sample ids
(republished by a restarted rollout worker) drop their group too, also counted.

Bad shards (truncated, unreadable, schema-invalid, a seal, header or payload checksum
mismatch, an unparsable name) go to ``quarantine/`` with a reason and training continues; a shard is
verified whole before any of its groups is handed out. Quarantines are counted in the
ledger at once and recounted on resume from ``quarantine/`` (see ``ledger``). A shard
from newer code (its header's checksum holds) raises ShardVersionError and stays where it
is; the trainer then stops once as a configuration error. Must not: write into ``ready/`` or run on more than one process.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_hpc.config.spool import SpoolConfig
from relax_hpc.paths import atomic_write_json, fsync_dir
from relax_hpc.spool.errors import ShardCorruptError, SpoolTimeout
from relax_hpc.spool.format import read_shard
from relax_hpc.spool.layout import (
    ShardName,
    SpoolLayout,
    claimed_name,
    list_names,
    parse_claimed,
    rename_once,
)
from relax_hpc.spool.ledger import DELIVERED, DUPLICATE, STALE, Ledger, sample_key
from relax_hpc.spool.quarantine import clean_abandoned_tmp, list_quarantined, quarantine_shard
from relax_hpc.spool.redo import MAX_ATTEMPTS, RedoRequest, attempt_of, request_redo
from relax_hpc.spool.sample import Group

log = logging.getLogger(__name__)
_TMP_CLEAN_INTERVAL_S = 60.0
_THROUGHPUT_WINDOW = 20  # recent steps kept in reader.json for the status CLI
# reader.json is for people and the status CLI: rewritten at most this often between
# checkpoints (each write is ~0.3-1 ms of a ~50 ms grpo_tiny step), and at every checkpoint.
_STATUS_INTERVAL_S = 1.0


class SpoolReader:
    def __init__(
        self,
        spool_dir: Path | str,
        config: SpoolConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._config = (config or SpoolConfig()).validate()
        self._layout = SpoolLayout(Path(spool_dir)).create()
        self._clock = clock
        self._sleep = sleep
        self._ledger = Ledger(self._config.ledger_keep_steps)
        self._groups: dict[str, list[Group]] = {}  # decoded shards on the stream
        self._ready: deque[str] = deque()  # cached listing of ready/, oldest first
        self._recovered = False
        self._claims_unflushed = False  # renames into claimed/ since its last fsync
        self._last_tmp_clean = -_TMP_CLEAN_INTERVAL_S
        self._recent: deque[tuple[float, int]] = deque(maxlen=_THROUGHPUT_WINDOW)
        self._last_batch: dict[str, float] = {}
        self._last_record: dict = {}
        self._last_status_write = -_STATUS_INTERVAL_S

    # --- trainer API -----------------------------------------------------------------------------
    def next_batch(
        self, num_groups: int, policy_version: int, timeout_s: float | None = None
    ) -> list[Group]:
        """The next ``num_groups`` deliverable groups, claiming shards as needed.

        Blocks (polling every ``poll_s``) until enough groups are ready; after ``timeout_s``
        raises SpoolTimeout and leaves the ledger as if it had not been called.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self._recover()
        start = self._clock()
        deadline = None if timeout_s is None else start + timeout_s
        batch: list[Group] = []
        self._ledger.begin_batch()
        try:
            while len(batch) < num_groups:
                if not self._take_one(policy_version, batch) and not self._claim_one():
                    self._wait(deadline, num_groups, len(batch))
        except BaseException:
            self._ledger.rollback_batch()
            raise
        self._ledger.commit_batch()
        self._evict_taken()
        self._last_batch = self._batch_metrics(batch, policy_version, self._clock() - start)
        return batch

    def mark_step_consumed(self, step: int) -> None:
        """The groups handed out since the last call were consumed by training ``step``."""
        self._recover()
        record = self._ledger.commit_step(step)
        self._request_redos(self._ledger.pending_redos())
        self._recent.append((time.time(), self._ledger.counters["num_delivered_samples"]))
        self._last_record = record
        now = self._clock()
        if now - self._last_status_write >= _STATUS_INTERVAL_S:
            self._last_status_write = now
            self._write_status()

    def on_checkpoint_complete(self, step: int) -> None:
        """The checkpoint of ``step`` (holding ``state_dict()``) is durable: collect shards."""
        self._recover()
        if step > self._ledger.step:
            raise ValueError(
                f"checkpoint step {step} is after the last consumed step {self._ledger.step}"
            )
        self._request_redos(self._ledger.pending_redos(step))  # durable before settled
        self._ledger.settle_redos(step)
        for name in self._ledger.collectable(step):
            self._retire(name)
            self._ledger.forget(name)
        fsync_dir(self._layout.claimed_dir)
        self._ledger.checkpointed_step = max(self._ledger.checkpointed_step, step)
        self._write_status()

    def state_dict(self) -> dict[str, Any]:
        """The ledger of steps <= the last ``mark_step_consumed``.

        One opaque JSON string under a fixed key: torch DCP loads only keys present in the
        template state dict, so variable content (shard names) must live inside one value.
        """
        self._flush_claims()  # the checkpoint must not record a claim a crash can undo
        return {"spool_ledger": json.dumps(self._ledger.state(), sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a complete checkpoint's ``state_dict()``; call before ``next_batch``."""
        if self._recovered:
            raise ValueError("load_state_dict must be called before the first next_batch")
        ledger = Ledger.from_state(
            json.loads(state["spool_ledger"]), self._config.ledger_keep_steps
        )
        self._ledger = ledger
        self._recover()

    def metrics(self) -> dict[str, float]:
        """Counters (cumulative, as of the last step) and the last batch's figures."""
        counters = {f"spool/{k}": float(v) for k, v in sorted(self._ledger.counters.items())}
        return {**counters, **self._last_batch}

    # --- the stream ------------------------------------------------------------------------------
    def _take_one(self, policy_version: int, batch: list[Group]) -> bool:
        """Take the stream's next group into ``batch`` (or drop it); False if none is claimed."""
        while (cursor := self._ledger.head()) is not None:
            groups = self._load(cursor.name)
            if groups is None:
                continue  # quarantined or missing; the ledger forgot it
            group = groups[cursor.taken]
            keys = [sample_key(s.sample_id) for s in group]
            outcome = self._classify(group, keys, policy_version)
            self._ledger.take(cursor.name, keys, outcome)
            if outcome == DELIVERED:
                batch.append(group)
                if attempt_of(group[0].sample_id):
                    self._ledger.count("num_regenerated_groups")
            elif outcome == STALE:
                self._redo(group, policy_version)
            return True
        return False

    def _classify(self, group: Group, keys: list[int], policy_version: int) -> str:
        num_seen = self._ledger.num_seen(keys)
        if num_seen or len(set(keys)) != len(keys):
            log.warning(
                "spool: group %s repeats %d delivered sample ids; dropped",
                group[0].group_id,
                num_seen,
            )
            return DUPLICATE
        staleness = policy_version - min(s.policy_version for s in group)
        if 0 <= self._config.max_staleness < staleness:
            return STALE
        return DELIVERED

    def _redo(self, group: Group, policy_version: int) -> None:
        """Send a stale group back to the prompt stream, or count it lost after its last try."""
        attempt = attempt_of(group[0].sample_id) + 1
        if attempt > MAX_ATTEMPTS or not group[0].group_id.isdigit():
            log.error(
                "spool: group %s came back stale %d times (or is not a prompt index); lost",
                group[0].group_id,
                attempt,
            )
            self._ledger.count("num_lost_groups")
            self._ledger.count("num_redo_abandoned_groups")
            return
        self._ledger.record_redo(int(group[0].group_id), attempt, policy_version)

    def _request_redos(self, pending: list[tuple[int, int, int]]) -> None:
        for group, attempt, min_version in pending:
            if request_redo(self._layout.redo_dir, RedoRequest(group, attempt, min_version)):
                log.warning("spool: group %d dropped as stale; generating it again", group)

    def _load(self, name: str) -> list[Group] | None:
        if name in self._groups:
            return self._groups[name]
        path = self._layout.claimed_dir / name
        try:
            header, groups = read_shard(path)
            expected = parse_claimed(name)
            assert expected is not None, name
            if header.num_groups != expected[1].num_groups:
                raise ShardCorruptError(
                    f"{name}: holds {header.num_groups} groups, its name says {expected[1].num_groups}"
                )
        except FileNotFoundError:
            log.error("spool: claimed shard %s vanished; its unconsumed groups are lost", name)
            self._drop_missing(name)
            return None
        except ShardCorruptError as error:
            self._quarantine(path, str(error))
            return None
        self._groups[name] = groups
        return groups

    def _quarantine(self, path: Path, reason: str) -> None:
        """Move a bad shard aside and count it, with the groups it takes with it."""
        if quarantine_shard(self._layout, path, reason) is not None:
            self._ledger.record_quarantine(path.name, self._num_uncommitted_groups(path.name))
        elif any(c.name == path.name for c in self._ledger.cursors()):
            self._drop_missing(path.name)  # removed by someone else meanwhile

    def _num_uncommitted_groups(self, name: str) -> int:
        """Groups of a claimed shard that no committed step consumed (0 for other names)."""
        cursor = next((c for c in self._ledger.cursors() if c.name == name), None)
        if cursor is not None:
            return cursor.num_groups - cursor.committed
        parsed = parse_claimed(name)
        return parsed[1].num_groups if parsed else 0

    def _drop_missing(self, name: str) -> None:
        cursor = next(c for c in self._ledger.cursors() if c.name == name)
        self._ledger.counters["num_missing_shards"] += 1
        self._ledger.counters["num_lost_groups"] += cursor.num_groups - cursor.committed
        self._ledger.forget(name)

    def _evict_taken(self) -> None:
        taken = {c.name for c in self._ledger.cursors() if c.taken == c.num_groups}
        for name in [n for n in self._groups if n in taken]:
            del self._groups[name]

    # --- claiming --------------------------------------------------------------------------------
    def _claim_one(self) -> bool:
        """Move the oldest ready shard into ``claimed/`` and onto the stream; False if none."""
        if not self._ready:
            self._maybe_clean_tmp()
            self._ready.extend(list_names(self._layout.ready_dir))
        while self._ready:
            name = self._ready.popleft()
            source = self._layout.ready_dir / name
            shard = ShardName.parse(name)
            if shard is None:
                self._quarantine(source, "not a spool shard name")
                continue
            target = claimed_name(self._ledger.next_claim_seq, name)
            if not rename_once(source, self._layout.claimed_dir / target):
                continue  # requeued or removed by an operator meanwhile
            self._ledger.next_claim_seq += 1
            self._claims_unflushed = True  # flushed before a checkpoint records it
            self._ledger.add_shard(target, shard.num_groups)
            self._ledger.counters["num_claimed_shards"] += 1
            return True
        return False

    def _flush_claims(self) -> None:
        if self._claims_unflushed:
            fsync_dir(self._layout.claimed_dir)
            self._claims_unflushed = False

    def _wait(self, deadline: float | None, num_groups: int, num_have: int) -> None:
        if deadline is not None and self._clock() >= deadline:
            raise SpoolTimeout(f"spool: {num_have} of {num_groups} groups ready at the timeout")
        self._sleep(self._config.poll_s)

    def _maybe_clean_tmp(self) -> None:
        if self._clock() - self._last_tmp_clean >= _TMP_CLEAN_INTERVAL_S:
            self._last_tmp_clean = self._clock()
            clean_abandoned_tmp(self._layout, self._config.tmp_max_age_s)

    # --- recovery and garbage collection ---------------------------------------------------------
    def _recover(self) -> None:
        """Reconcile the ledger with ``claimed/`` (and ``consumed/``) once, before first use."""
        if self._recovered:
            return
        self._recovered = True
        ledger = self._ledger
        self._count_quarantined_since_checkpoint()
        on_disk = {n: parse_claimed(n) for n in list_names(self._layout.claimed_dir)}
        for name in list_names(self._layout.consumed_dir):
            parsed = parse_claimed(name)
            restore = any(c.name == name and not c.done for c in ledger.cursors())
            if (
                parsed
                and (restore or parsed[0] >= ledger.next_claim_seq)
                and rename_once(self._layout.consumed_dir / name, self._layout.claimed_dir / name)
            ):
                on_disk[name] = parsed  # consumed after this checkpoint: hand out again
        for name, parsed in sorted(on_disk.items()):
            if parsed is None:
                self._quarantine(self._layout.claimed_dir / name, "not a claimed shard name")
            elif not any(c.name == name for c in ledger.cursors()):
                ledger.add_shard(name, parsed[1].num_groups)
            ledger.next_claim_seq = max(ledger.next_claim_seq, parsed[0] + 1 if parsed else 0)
        for cursor in ledger.cursors():
            if cursor.name not in on_disk and not cursor.done:
                log.error("spool: shard %s of the checkpoint is missing", cursor.name)
                self._drop_missing(cursor.name)
        self.on_checkpoint_complete(ledger.step)  # the loaded checkpoint is complete
        fsync_dir(self._layout.claimed_dir)

    def _count_quarantined_since_checkpoint(self) -> None:
        """Count shards in ``quarantine/`` the loaded ledger does not know: an incarnation
        quarantined them after the checkpoint, then crashed before the next one."""
        for shard in list_quarantined(self._layout):
            if self._ledger.is_quarantine_counted(shard.name):
                continue
            lost = self._num_uncommitted_groups(shard.name)
            self._ledger.record_quarantine(shard.name, lost)
            parsed = parse_claimed(shard.name)
            if parsed is not None:
                self._ledger.next_claim_seq = max(self._ledger.next_claim_seq, parsed[0] + 1)
            log.warning(
                "spool: counting %s, quarantined after the checkpoint (%d groups lost): %s",
                shard.name,
                lost,
                shard.reason,
            )

    def _retire(self, name: str) -> None:
        path = self._layout.claimed_dir / name
        if self._config.keep_consumed:
            rename_once(path, self._layout.consumed_dir / name)
        else:
            path.unlink(missing_ok=True)
        self._groups.pop(name, None)

    # --- metrics and status ----------------------------------------------------------------------
    def _batch_metrics(
        self, batch: list[Group], policy_version: int, wait_s: float
    ) -> dict[str, float]:
        versions = [s.policy_version for g in batch for s in g]
        staleness = [policy_version - v for v in versions]
        return {
            "spool/wait_s": wait_s,
            "spool/staleness_mean": sum(staleness) / max(1, len(staleness)),
            "spool/staleness_max": float(max(staleness, default=0)),
        }

    def _write_status(self) -> None:
        status = {
            "step": self._ledger.step,
            "checkpointed_step": self._ledger.checkpointed_step,
            "counters": dict(self._ledger.counters),
            "last_record": self._last_record,
            "recent": list(self._recent),  # [unix_s, cumulative delivered samples]
            "updated_unix_s": time.time(),
        }
        # For the status CLI only: no fsync. The ledger that makes consumption exactly-once
        # lives in the trainer's checkpoint, not in this file.
        atomic_write_json(self._layout.reader_status_path, status, durable=False)
