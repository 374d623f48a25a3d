"""The sample spool: rollout workers publish finished groups as HDF5 shards in the run
directory; the trainer claims and consumes them exactly once, across crashes and resumes.

Modules (one responsibility each): ``sample`` (the data model), ``format`` (HDF5 shard
encoding), ``layout`` (folders and names under ``RunPaths.spool_dir``), ``writer``
(rollout side: publish, backlog), ``ledger`` (what each step consumed; the exactly-once
argument), ``reader`` (trainer side: claims, batches, checkpoint state), ``quarantine``
(bad shards, abandoned temp files), ``invariants`` (the property the tests check),
``cli`` (``python -m relax_hpc.spool RUN_DIR status|ls|inspect|quarantine|requeue``).

Works with POSIX rename/fsync semantics only (NFS, Lustre, GPFS); no file locks.
Must not: import torch, Hydra, or the trainer/rollout packages.
"""

from relax_hpc.config.spool import SpoolConfig
from relax_hpc.spool.errors import ShardCorruptError, ShardVersionError, SpoolError, SpoolTimeout
from relax_hpc.spool.format import SCHEMA_VERSION, ShardHeader, read_header, read_shard
from relax_hpc.spool.invariants import check_exactly_once
from relax_hpc.spool.reader import SpoolReader
from relax_hpc.spool.sample import AudioClip, Group, Sample
from relax_hpc.spool.writer import Backlog, ShardWriter, backlog, publish_groups, wait_for_room

__all__ = [
    "SCHEMA_VERSION",
    "AudioClip",
    "Backlog",
    "Group",
    "Sample",
    "ShardCorruptError",
    "ShardHeader",
    "ShardVersionError",
    "ShardWriter",
    "SpoolConfig",
    "SpoolError",
    "SpoolReader",
    "SpoolTimeout",
    "backlog",
    "check_exactly_once",
    "publish_groups",
    "read_header",
    "read_shard",
    "wait_for_room",
]
