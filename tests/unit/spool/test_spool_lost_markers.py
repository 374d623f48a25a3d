"""Claims, done markers and floors are not fsynced (rollout/assignment.py's docstring): a
node crash may lose any of them. Losing them must cost repeated work only: every group of
the prompt stream reaches the trainer exactly once."""

from __future__ import annotations

import shutil

import pytest
from spool_factories import make_group

from relax_hpc.rollout.assignment import GroupAssignment
from relax_hpc.spool import ShardWriter, SpoolReader, SpoolTimeout

P, C, BATCHES = 5, 2, 2  # chunks of 2, 2 and 1 groups


def generate(worker: GroupAssignment, writer: ShardWriter) -> None:
    """Claim, publish and complete chunks until every batch is below the floor."""
    while worker.floor() < BATCHES:
        chunk = worker.claim(max_batch=BATCHES - 1)
        assert chunk is not None
        writer.publish([make_group(f"g{g}") for g in chunk.groups])
        worker.complete(chunk)


def lose_every_marker(root) -> None:
    """What a crash may leave of names created without a directory fsync: none of them.
    The batch folders were collected under the floor; the floors go too."""
    shutil.rmtree(root / "floor")
    for folder in root.glob("b*"):
        shutil.rmtree(folder)


def test_lost_markers_repeat_work_and_the_trainer_gets_each_group_once(tmp_path):
    spool, root = tmp_path / "spool", tmp_path / "assign"
    before = GroupAssignment(root, "r0", P, C, lease_s=60.0)
    generate(before, ShardWriter(spool, writer_id="rollout.r0"))
    lose_every_marker(root)
    after = GroupAssignment(root, "r0", P, C, lease_s=60.0)  # the restarted worker
    assert after.floor() == 0 and after.lowest_open_batch() == 0  # it all looks open
    generate(after, ShardWriter(spool, writer_id="rollout.r0"))

    assert len(list((spool / "ready").iterdir())) == 2 * BATCHES * 3  # every chunk twice
    reader = SpoolReader(spool)
    delivered = []
    for step in range(1, BATCHES + 1):
        delivered += [g[0].group_id for g in reader.next_batch(P, 0)]
        reader.mark_step_consumed(step)
    assert delivered == [f"g{g}" for g in range(P * BATCHES)]
    with pytest.raises(SpoolTimeout):
        reader.next_batch(1, 0, timeout_s=0.5)  # the regenerated copies: all duplicates
