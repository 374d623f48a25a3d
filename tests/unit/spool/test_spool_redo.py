"""Stale groups go back to the prompt stream (spool/redo.py, ledger, reader): asked for
once per (group, attempt), again after a resume that would otherwise lose the request,
never twice; a redo is delivered under its own sample ids and counted; a group stale on
every attempt is lost, loudly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spool_factories import make_sample

from relax_hpc.spool import SpoolConfig, SpoolReader, SpoolTimeout, publish_groups
from relax_hpc.spool.layout import SpoolLayout
from relax_hpc.spool.redo import (
    MAX_ATTEMPTS,
    RedoRequest,
    attempt_of,
    open_requests,
    redo_sample_id,
    request_redo,
)


def group(g: int, policy_version: int, attempt: int = 0, n: int = 2) -> list:
    return [
        make_sample(redo_sample_id(g, j, attempt), str(g), policy_version, seed=g * 10 + j)
        for j in range(n)
    ]


def reader(spool: Path) -> SpoolReader:
    return SpoolReader(spool, SpoolConfig(poll_s=0.01, max_staleness=0))


def requests(spool: Path) -> list[RedoRequest]:
    return open_requests(SpoolLayout(spool).redo_dir)


def drop_group_7(spool: Path) -> SpoolReader:
    """Step 1 at version 3 drops group 7 (version 2) and trains group 8."""
    publish_groups(spool, [group(7, 2), group(8, 3)], "w0")
    r = reader(spool)
    assert [g[0].group_id for g in r.next_batch(1, policy_version=3)] == ["8"]
    return r


def test_sample_ids_of_a_redo_differ_and_name_their_attempt():
    assert [redo_sample_id(5, 1, a) for a in (0, 2)] == ["5/1", "5/1.r2"]
    assert [attempt_of(s) for s in ("5/1", "5/1.r2", "5/1#t3")] == [0, 2, 0]


def test_requests_are_idempotent_and_open_until_done(tmp_path):
    redo_dir = tmp_path / "redo"
    request = RedoRequest(group=4, attempt=1, min_policy_version=9)
    assert request_redo(redo_dir, request)
    assert not request_redo(redo_dir, RedoRequest(4, 1, 10))  # the first one stands
    assert open_requests(redo_dir) == [request]
    (redo_dir / f"{request.key}.done").write_text("{}")
    assert open_requests(redo_dir) == []


def test_a_stale_drop_is_asked_for_again_once_the_step_is_consumed(tmp_path):
    r = drop_group_7(tmp_path)
    assert requests(tmp_path) == []  # the step is not consumed yet
    r.mark_step_consumed(1)
    assert requests(tmp_path) == [RedoRequest(group=7, attempt=1, min_policy_version=3)]
    metrics = r.metrics()
    assert metrics["spool/num_stale_groups"] == 1
    assert metrics["spool/num_redo_requested_groups"] == 1


def test_the_redo_is_delivered_under_its_own_ids_and_counted(tmp_path):
    r = drop_group_7(tmp_path)
    r.mark_step_consumed(1)
    publish_groups(tmp_path, [group(7, 3, attempt=1)], "w1")
    [redone] = r.next_batch(1, policy_version=3)
    assert [s.sample_id for s in redone] == ["7/0.r1", "7/1.r1"]
    r.mark_step_consumed(2)
    assert r.metrics()["spool/num_regenerated_groups"] == 1
    assert r.metrics().get("spool/num_duplicate_groups", 0) == 0


def test_a_fresh_copy_of_a_dropped_group_is_a_duplicate_beside_its_redo(tmp_path):
    """A hung holder's stale copy came first; the takeover's fresh copy (same ids) must not
    be trained as well as the redo, nor ask for a second one."""
    r = drop_group_7(tmp_path)
    publish_groups(tmp_path, [group(7, 3), group(7, 3, attempt=1)], "w1")
    [redone] = r.next_batch(1, policy_version=3)
    assert [s.sample_id for s in redone] == ["7/0.r1", "7/1.r1"]
    r.mark_step_consumed(1)
    metrics = r.metrics()
    assert metrics["spool/num_duplicate_groups"] == 1
    assert metrics["spool/num_redo_requested_groups"] == 1


def test_a_batch_rolled_back_at_a_timeout_asks_for_nothing(tmp_path):
    publish_groups(tmp_path, [group(7, 2)], "w0")
    r = reader(tmp_path)
    with pytest.raises(SpoolTimeout):
        r.next_batch(1, policy_version=3, timeout_s=0.05)
    publish_groups(tmp_path, [group(8, 3)], "w0")
    r.next_batch(1, policy_version=3)  # group 7 is taken (and dropped) again: once
    r.mark_step_consumed(1)
    assert len(requests(tmp_path)) == 1
    assert r.metrics()["spool/num_redo_requested_groups"] == 1


def test_a_group_stale_on_every_attempt_is_lost_and_counted(tmp_path):
    publish_groups(tmp_path, [group(7, 2, attempt=MAX_ATTEMPTS), group(8, 3)], "w0")
    r = reader(tmp_path)
    r.next_batch(1, policy_version=3)
    r.mark_step_consumed(1)
    assert requests(tmp_path) == []
    metrics = r.metrics()
    assert metrics["spool/num_lost_groups"] == 1
    assert metrics["spool/num_redo_abandoned_groups"] == 1


def test_a_redo_stale_again_is_asked_for_with_the_next_attempt(tmp_path):
    publish_groups(tmp_path, [group(7, 2, attempt=1), group(8, 3)], "w0")
    r = reader(tmp_path)
    r.next_batch(1, policy_version=3)
    r.mark_step_consumed(1)
    assert requests(tmp_path) == [RedoRequest(7, 2, 3)]


def test_a_checkpoint_holds_the_drop_until_it_is_durable(tmp_path):
    """Crash after the step, before its request reached the disk: the resume asks again."""
    r = drop_group_7(tmp_path)
    r.mark_step_consumed(1)
    state = r.state_dict()
    assert json.loads(state["spool_ledger"])["pending_redos"] == [[7, 1, 3, 1]]
    for path in SpoolLayout(tmp_path).redo_dir.iterdir():
        path.unlink()  # the request never made it
    resumed = reader(tmp_path)
    resumed.load_state_dict(state)
    assert requests(tmp_path) == [RedoRequest(7, 1, 3)]
    # durable now: the next checkpoint no longer holds it
    assert json.loads(resumed.state_dict()["spool_ledger"])["pending_redos"] == []


def test_a_resume_that_replays_the_drop_asks_for_the_same_redo_once(tmp_path):
    r = reader(tmp_path)
    empty = r.state_dict()  # the checkpoint before step 1
    publish_groups(tmp_path, [group(7, 2), group(8, 3)], "w0")
    r.next_batch(1, policy_version=3)
    r.mark_step_consumed(1)  # then the trainer dies before its next checkpoint
    replay = reader(tmp_path)
    replay.load_state_dict(empty)
    assert [g[0].group_id for g in replay.next_batch(1, policy_version=3)] == ["8"]
    replay.mark_step_consumed(1)
    assert requests(tmp_path) == [RedoRequest(7, 1, 3)]
    assert len(list(SpoolLayout(tmp_path).redo_dir.glob("*.json"))) == 1
    # a redo done before the crash is never asked for again
    (SpoolLayout(tmp_path).redo_dir / f"{RedoRequest(7, 1, 3).key}.done").write_text("{}")
    replay.on_checkpoint_complete(1)
    assert requests(tmp_path) == []


def test_the_ledger_state_settles_drops_with_the_checkpoint(tmp_path):
    r = drop_group_7(tmp_path)
    r.mark_step_consumed(1)
    r.on_checkpoint_complete(1)
    assert json.loads(r.state_dict()["spool_ledger"])["pending_redos"] == []
    assert requests(tmp_path) == [RedoRequest(7, 1, 3)]
