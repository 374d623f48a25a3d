"""One spool process of the fault tests, SIGKILLed at a chosen instruction.

``python spool_fault_worker.py ACTION SPOOL_DIR STATE_DIR``:

* ``consume``: the trainer's side. Takes 2 groups as step 1, checkpoints (``STATE_DIR/
  checkpoint.json``, as the trainer would), then takes 1 more group, records it in
  ``STATE_DIR/taken.json`` and dies by SIGKILL before the next checkpoint.
* ``quarantine``: quarantines ``STATE_DIR/victim.h5`` and dies inside the reason file's
  atomic write, after the temp file is written and before its rename.
* ``publish``: publishes one group and dies before the shard's rename into ``ready/``.

``flip_stored_byte`` is the corruption of the fault and storm tests.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import h5py

from relax_hpc.paths import atomic_write_json
from relax_hpc.spool import ShardWriter, SpoolConfig, SpoolReader
from relax_hpc.spool.layout import SpoolLayout
from relax_hpc.spool.quarantine import quarantine_shard


def flip_stored_byte(path: Path, dataset: str = "text") -> None:
    """Flip one bit in the middle of ``dataset``'s bytes in the file (not through HDF5), as a
    storage fault would; the header and every HDF5 structure stay intact."""
    with h5py.File(path, "r") as h5:
        offset = h5[dataset].id.get_offset() + h5[dataset].id.get_storage_size() // 2
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x10]))


def _die(*_args, **_kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def consume(spool_dir: Path, state_dir: Path) -> None:
    reader = SpoolReader(spool_dir, SpoolConfig(poll_s=0.01))
    reader.next_batch(2, policy_version=0, timeout_s=30)
    reader.mark_step_consumed(1)
    atomic_write_json(state_dir / "checkpoint.json", reader.state_dict())
    reader.on_checkpoint_complete(1)
    (group,) = reader.next_batch(1, policy_version=0, timeout_s=30)
    atomic_write_json(state_dir / "taken.json", [s.sample_id for s in group])
    _die()


def quarantine(spool_dir: Path, state_dir: Path) -> None:
    os.replace = _die  # atomic_write_json's rename: the temp is complete, the rename never runs
    quarantine_shard(SpoolLayout(spool_dir), state_dir / "victim.h5", "fault test")


def publish(spool_dir: Path, state_dir: Path) -> None:
    from spool_crash_worker import make_group

    os.rename = _die  # the shard's rename from tmp/ into ready/
    ShardWriter(spool_dir, writer_id="fault.w0").publish([make_group(0, 0)])


if __name__ == "__main__":
    action, spool, state = sys.argv[1:4]
    {"consume": consume, "quarantine": quarantine, "publish": publish}[action](
        Path(spool), Path(state)
    )
    sys.exit(f"{action} was not killed")
