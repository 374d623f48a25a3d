"""The groups of ``tests/data/spool/shard_v2.h5`` and ``shard_v3.h5``: a schema-version-2
shard written by the writer of version 2 (relax_hpc at commit 2fabcb2, before version 3)
and a version-3 shard written by the writer of version 3 (at commit c774a87, before version
4), each from exactly these groups, so that a reader of a later version can be checked
against them field by field. Every kind of field is in them: all-fields samples with
images and audio, a plain text group, a group sharing one media payload and a group whose
samples hold their own.

Never regenerate the files with a newer writer: their whole point is the old writers' bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from spool_factories import make_full_sample, make_group

from relax_hpc.media.payload import MediaPayload
from relax_hpc.spool import Sample

V2_SHARD_PATH = Path(__file__).resolve().parents[2] / "data" / "spool" / "shard_v2.h5"
V2_WRITER_ID = "rollout-v2"
V2_CREATED_UNIX_S = 1_765_000_000.5
V3_SHARD_PATH = V2_SHARD_PATH.with_name("shard_v3.h5")
V3_WRITER_ID = "rollout-v3"
V3_CREATED_UNIX_S = 1_765_100_000.25


def _payload(seed: int, shapes: tuple, clips: tuple) -> MediaPayload:
    rng = np.random.default_rng(seed)
    images = tuple(rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes)
    audio = tuple(rng.standard_normal(n).astype(np.float32) for n in clips)
    return MediaPayload(images, audio, sampling_rate_hz=16000, fingerprint=f"fp{seed}")


def v2_fixture_groups() -> list[list[Sample]]:
    full = [make_full_sample(f"full-s{k}", "full", seed=k + 1) for k in range(2)]
    text = make_group("text", 3, policy_version=5)
    shared = make_group("shared", 2, policy_version=6)
    payload = _payload(3, ((4, 6), (2, 3)), (5,))
    for sample in shared:
        sample.media = payload
    own = make_group("own", 3, policy_version=6)
    own[0].media, own[2].media = _payload(4, ((3, 3),), ()), _payload(5, (), (7, 2))
    return [full, text, shared, own]
