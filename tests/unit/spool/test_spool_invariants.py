"""The exactly-once checker, a simulated crash/resume history, and proof that the checker
catches a broken ledger.

``run_scenario`` drives a real spool (files in a temp dir) through publish / train step /
checkpoint / crash operations; a crash drops the reader and the history after the last
*complete* checkpoint, exactly as a killed trainer loses them. Crashes happen between
calls here; ``tests/dist/test_spool_crash.py`` kills real processes at any instruction.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spool_factories import make_group

from relax_hpc.spool import ShardWriter, SpoolConfig, SpoolReader, SpoolTimeout, check_exactly_once
from relax_hpc.spool.layout import list_names
from relax_hpc.spool.ledger import Ledger


# --- the checker itself -------------------------------------------------------------------------
def test_checker_accepts_exactly_once() -> None:
    assert check_exactly_once(["a", "b", "c", "c"], [["a"], [], ["c", "b"]]) == []


@pytest.mark.parametrize(
    ("steps", "problem"),
    [
        ([["a", "b"], ["b", "c"]], "more than once"),
        ([["a", "b", "b", "c"]], "more than once"),
        ([["a"], ["c"]], "never consumed: b"),
        ([["a", "b", "c", "x"]], "never published: x"),
    ],
)
def test_checker_reports_each_violation(steps: list[list[str]], problem: str) -> None:
    violations = check_exactly_once(["a", "b", "c"], steps)
    assert len(violations) == 1 and problem in violations[0]


# --- a simulated trainer with checkpoints and crashes ---------------------------------------
class SimulatedTrainer:
    def __init__(self, spool_dir: Path, batch_groups: int) -> None:
        self.spool_dir = spool_dir
        self.batch_groups = batch_groups
        self.checkpoints: list[tuple[int, dict, list]] = []  # complete ones only
        self.crash()

    def crash(self) -> None:
        """Kill and restart: resume from the newest complete checkpoint."""
        self.reader = SpoolReader(self.spool_dir, SpoolConfig(poll_s=0.001))
        self.step, self.history = 0, []
        if self.checkpoints:
            self.step, state, history = self.checkpoints[-1]
            self.reader.load_state_dict(state)
            self.history = list(history)

    def train_step(self) -> bool:
        try:
            groups = self.reader.next_batch(self.batch_groups, policy_version=0, timeout_s=0)
        except SpoolTimeout:
            return False
        self.step += 1
        self.reader.mark_step_consumed(self.step)
        self.history.append([s.sample_id for g in groups for s in g])
        return True

    def checkpoint(self, crash_at: str | None = None) -> None:
        state = self.reader.state_dict()
        if crash_at == "while_writing":
            return self.crash()
        self.checkpoints.append((self.step, state, list(self.history)))
        if crash_at == "before_collecting":
            return self.crash()
        self.reader.on_checkpoint_complete(self.step)


class SimulatedRollout:
    def __init__(self, spool_dir: Path) -> None:
        self.writer = ShardWriter(spool_dir, "sim.w0", shard_max_samples=6)
        self.next_group = 0
        self.last: list = []
        self.published: set[str] = set()

    def publish(self, num_groups: int, duplicate_last: bool = False) -> None:
        groups = list(self.last) if duplicate_last else []
        new = [
            make_group(f"g{self.next_group + i}", size=1 + (self.next_group + i) % 3)
            for i in range(num_groups)
        ]
        self.next_group += num_groups
        self.writer.publish(groups + new)
        self.last = new
        self.published |= {s.sample_id for g in new for s in g}


def run_scenario(spool_dir: Path, ops: list[tuple], batch_groups: int = 3) -> list[str]:
    """Apply ``ops``, then drain and checkpoint; the exactly-once violations."""
    rollout, trainer = SimulatedRollout(spool_dir), SimulatedTrainer(spool_dir, batch_groups)
    for op, *args in ops:
        if op == "publish":
            rollout.publish(*args)
        elif op == "step":
            trainer.train_step()
        elif op == "checkpoint":
            trainer.checkpoint(*args)
        elif op == "crash":
            trainer.crash()
    trainer.batch_groups = 1
    while trainer.train_step():
        pass
    trainer.checkpoint()
    return check_exactly_once(rollout.published, trainer.history)


OPS = st.one_of(
    st.tuples(st.just("publish"), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("step")),
    st.tuples(st.just("checkpoint"), st.sampled_from([None, "while_writing", "before_collecting"])),
    st.tuples(st.just("crash")),
)


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OPS, max_size=25), batch_groups=st.integers(1, 4))
def test_exactly_once_across_random_crashes(ops: list[tuple], batch_groups: int) -> None:
    with tempfile.TemporaryDirectory() as spool_dir:
        assert run_scenario(Path(spool_dir), ops, batch_groups) == []


# --- breaking the ledger on purpose: the checker must notice ----------------------------------
# Groups of 1, 2, 3, 1, 2, 3, ... samples make shards [g0 g1 g2] [g3 g4 g5] [g6 g7]; batches
# of two groups. Step 1 takes g0 g1; checkpoint; step 2 finishes shard 0 and claims shard 1
# (g2 g3); crash. The resume must hand out g2 and g3 again, and nothing before them.
CRASH_AFTER_UNCHECKPOINTED_STEP = [
    ("publish", 8),
    ("step",),
    ("checkpoint",),
    ("step",),
    ("crash",),
]


def _collect_at_step_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Delete consumed shards when the step ends instead of when a checkpoint covers them."""
    original = SpoolReader.mark_step_consumed

    def eager(self: SpoolReader, step: int) -> None:
        original(self, step)
        for name in self._ledger.collectable(step):
            self._retire(name)
            self._ledger.forget(name)

    monkeypatch.setattr(SpoolReader, "mark_step_consumed", eager)


def _forget_positions_on_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop the per-shard positions and the seen sample ids from the loaded state."""
    original = Ledger.from_state.__func__

    def amnesiac(cls, state: dict, keep_steps: int = 1000) -> Ledger:
        return original(cls, dict(state, shards=[], seen_sample_keys=""), keep_steps)

    monkeypatch.setattr(Ledger, "from_state", classmethod(amnesiac))


def _treat_unrecorded_claims_as_consumed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On resume, discard claimed shards the checkpoint does not mention."""
    original = SpoolReader._recover

    def forgetful(self: SpoolReader) -> None:
        if not self._recovered:
            known = {c.name for c in self._ledger.cursors()}
            for name in list_names(self._layout.claimed_dir):
                if name not in known:
                    (self._layout.claimed_dir / name).unlink()
        original(self)

    monkeypatch.setattr(SpoolReader, "_recover", forgetful)


def test_intact_ledger_passes_the_crash_scenario(tmp_path: Path) -> None:
    assert run_scenario(tmp_path, CRASH_AFTER_UNCHECKPOINTED_STEP, batch_groups=2) == []


@pytest.mark.parametrize(
    ("break_ledger", "problem"),
    [
        (_collect_at_step_end, "never consumed"),
        (_forget_positions_on_load, "more than once"),
        (_treat_unrecorded_claims_as_consumed, "never consumed"),
    ],
)
def test_checker_catches_a_broken_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, break_ledger, problem: str
) -> None:
    break_ledger(monkeypatch)
    violations = run_scenario(tmp_path, CRASH_AFTER_UNCHECKPOINTED_STEP, batch_groups=2)
    assert any(problem in v for v in violations), violations
