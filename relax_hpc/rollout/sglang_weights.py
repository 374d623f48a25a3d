"""How the trainer's weights reach an ``SGLangEngine``, through SGLang's own update API.

Routes, and what each is verified by:

1. Rounds of the bucketed broadcast, and the receiver's own filesystem fallback: the
   ``WeightReceiver`` receives (or reads ``weights/v{N}/``), verifies signature and
   checksums, then calls ``SGLangWeightLoader`` as its ``load_fn``, which hands the named
   tensors to SGLang's ``update_weights_from_tensor``. The receiver keeps its fail-closed
   bookkeeping unchanged; the rollout stamps the new ``policy_version`` only afterwards.
2. Start and restart: ``load_latest_published`` checks the newest ``weights/v{N}/``
   against its manifest (size and crc32) and loads it with ``update_weights_from_disk``:
   SGLang reads the safetensors itself, each TP rank its own shard, nothing is copied
   through this process. Its version seeds the receiver (``initial_policy_version``).
3. SGLang's distributed update (``weightsync.transport=sglang_distributed``): a
   ``PerTensorReceiver`` (``weightsync.per_tensor``) reads the signed plan, then
   ``SGLangDistributedTarget`` has SGLang join the trainer's group
   (``init_weights_update_group``, this engine's ranks from the plan's ``rank_offset``)
   and receive every tensor of the manifest (``update_weights_from_distributed``, names,
   dtypes, shapes in broadcast order). Verified by: the plan's signature (checked before
   SGLang is called) and SGLang's success reply; SGLang exposes no checksum of what it
   loaded, so the trainer's per-tensor checksums cannot be compared here (``verify``
   accepts). The receiver stamps ``policy_version`` only after both.

Verified on CPU (with a stand-in engine): routes 1 and 2 call the right SGLang methods
and refuse a corrupt export; route 3's calls and arguments; the trainer side of route 3
against a process that receives exactly as SGLang's workers do (tests/dist/). Only a GPU
run shows SGLang accepting the tensors, the folder and the broadcasts
(tests/gpu/test_sglang_engine.py).

Must not: import the trainer, or change the weight-sync protocol.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from relax_hpc.paths import RunPaths, read_json
from relax_hpc.rollout.engines.sglang_engine import SGLangEngine
from relax_hpc.weightsync import WeightVerificationError, fs_export, protocol
from relax_hpc.weightsync.per_tensor import GroupEndpoint

log = logging.getLogger(__name__)
CRC_CHUNK_BYTES = 64 << 20


class SGLangWeightLoader:
    """The receiver's ``load_fn`` for an ``SGLangEngine``, plus its start-up load from disk."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine

    def __call__(self, tensors: Mapping[str, Tensor]) -> None:
        self.engine.push_tensors(tensors)

    def load_latest_published(self, paths: RunPaths) -> int | None:
        """Load the newest verified ``weights/v{N}/``; its version, or None if there is none."""
        version = fs_export.latest_published_version(paths)
        if version is None:
            return None
        version_dir = paths.weights_version_dir(version)
        try:
            verify_published_dir(version_dir)
        except (FileNotFoundError, WeightVerificationError) as error:
            # pruned by the trainer meanwhile, or damaged: the receiver will load a later one
            log.warning("rollout: cannot load published weights v%d: %s", version, error)
            return None
        self.engine.update_weights_from_disk(version_dir, version)
        log.info("rollout: SGLang loaded published policy_version %d from disk", version)
        return version


class SGLangDistributedTarget:
    """A ``PerTensorEngine`` (see ``weightsync.per_tensor``) backed by an ``SGLangEngine``."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine
        self.num_ranks = engine.tensor_parallel
        self._group_name = ""

    def join_group(self, endpoint: GroupEndpoint) -> None:
        self.engine.init_weights_update_group(
            master_address=endpoint.master_address,
            master_port=endpoint.master_port,
            rank_offset=endpoint.rank_offset,
            world_size=endpoint.world_size,
            backend=endpoint.backend,
            group_name=endpoint.group_name,
        )
        self._group_name = endpoint.group_name

    def receive(self, specs: list[protocol.TensorSpec]) -> None:
        """Blocks until SGLang loaded every tensor; raises ``SGLangCallFailed`` otherwise."""
        self.engine.update_weights_from_distributed(specs, None, self._group_name)

    def verify(self, specs: list[protocol.TensorSpec], checksums: list[int], algo: str) -> None:
        """SGLang's success reply is the verification (see the module docstring)."""
        if len(checksums) != len(specs):
            raise WeightVerificationError(
                f"digest has {len(checksums)} checksums for {len(specs)} tensors"
            )

    def leave_group(self, group_name: str) -> None:
        try:
            self.engine.destroy_weights_update_group(group_name)
        except Exception as error:  # a broken group may not tear down cleanly; it is unused
            log.warning("rollout: leaving SGLang weight-update group %s: %s", group_name, error)


def verify_published_dir(version_dir: Path) -> None:
    """Check the safetensors file against the manifest the trainer wrote next to it."""
    manifest = read_json(version_dir / fs_export.MANIFEST_FILE)
    weights_path = version_dir / fs_export.WEIGHTS_FILE
    num_bytes, crc = 0, 0
    with open(weights_path, "rb") as handle:
        while chunk := handle.read(CRC_CHUNK_BYTES):
            num_bytes += len(chunk)
            crc = zlib.crc32(chunk, crc)
    if num_bytes != manifest["num_bytes"] or crc != manifest["crc32"]:
        raise WeightVerificationError(f"{weights_path} does not match its manifest")
