"""Spool throughput: publish, claim+read, end to end, as a ratio of raw filesystem bandwidth.

For each workload (256 samples x 2k tokens per shard; the same with a 224x224x3 image per
sample) it writes the same bytes twice in the same directory, interleaved and repeated:

* raw: ``write`` + ``fsync`` + ``close`` of files of the shard size (the best a writer can do),
* publish: ``ShardWriter.publish`` (HDF5 encode, fsync, rename, directory fsync, status),

then claims and reads everything back with ``SpoolReader.next_batch`` (rename into
``claimed/``, read, validate, build samples) and collects it after a checkpoint, against a
raw sequential read of the same files. The goal for large shards is publish >= 0.7 x raw.
It also times the shard checksums alone (zlib CRC-32 over the same bytes, computed once by
the writer and once by the reader) and prints their share of publish and of claim+read.
Reads right after writes come from the page cache on a local disk; pass ``--dir`` on the
cluster filesystem for meaningful figures there.

    python benchmarks/spool_throughput.py [--dir PATH] [--num-shards 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from relax_hpc.spool import Sample, ShardWriter, SpoolConfig, SpoolReader

PROMPT_TOKENS = 512
RESPONSE_TOKENS = 1536
SAMPLES_PER_SHARD = 256
GROUP_SIZE = 8


def make_shard_groups(shard: int, with_image: bool, rng: np.random.Generator) -> list[list[Sample]]:
    image = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    groups = []
    for g in range(SAMPLES_PER_SHARD // GROUP_SIZE):
        group_id = f"s{shard}-g{g}"
        groups.append(
            [
                Sample(
                    sample_id=f"{group_id}-{k}",
                    group_id=group_id,
                    data_index=g,
                    prompt_token_ids=rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32),
                    response_token_ids=rng.integers(0, 150_000, RESPONSE_TOKENS, dtype=np.int32),
                    loss_mask=np.ones(RESPONSE_TOKENS, np.uint8),
                    rollout_logprobs=-rng.random(RESPONSE_TOKENS, dtype=np.float32),
                    reward=1.0,
                    policy_version=0,
                    finish_reason="stop",
                    timings_s={"generate": 1.0},
                    images=[image] if with_image else [],
                )
                for k in range(GROUP_SIZE)
            ]
        )
    return groups


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _raw_write(folder: Path, sizes: list[int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    payload = memoryview(os.urandom(max(sizes)))
    for i, size in enumerate(sizes):
        with open(folder / f"raw{i}.bin", "wb") as handle:
            handle.write(payload[:size])
            handle.flush()
            os.fsync(handle.fileno())


def _raw_read(folder: Path) -> None:
    for path in sorted(folder.iterdir()):
        path.read_bytes()


def _publish(spool_dir: Path, shards: list) -> list[Path]:
    writer = ShardWriter(spool_dir, "bench.w0", shard_max_samples=SAMPLES_PER_SHARD)
    return [path for groups in shards for path in writer.publish(groups)]


def _consume(spool_dir: Path, num_shards: int) -> None:
    reader = SpoolReader(spool_dir, SpoolConfig(poll_s=0.01))
    for step in range(1, num_shards + 1):
        reader.next_batch(SAMPLES_PER_SHARD // GROUP_SIZE, policy_version=0, timeout_s=30)
        reader.mark_step_consumed(step)
    reader.on_checkpoint_complete(num_shards)


def _checksum(buffers: list[bytes]) -> None:
    for buffer in buffers:
        zlib.crc32(buffer)


def run_workload(root: Path, name: str, with_image: bool, num_shards: int, repeats: int) -> None:
    rng = np.random.default_rng(0)
    shards = [make_shard_groups(i, with_image, rng) for i in range(num_shards)]
    best = {"raw_write": np.inf, "publish": np.inf, "raw_read": np.inf, "consume": np.inf}
    best["checksum"] = np.inf
    num_bytes = 0
    for round_index in range(repeats):
        spool_dir, raw_dir = (
            root / f"{name}-{round_index}" / "spool",
            root / f"{name}-{round_index}" / "raw",
        )
        start = time.perf_counter()
        paths = _publish(spool_dir, shards)
        best["publish"] = min(best["publish"], time.perf_counter() - start)
        sizes = [p.stat().st_size for p in paths]
        num_bytes = sum(sizes)
        best["raw_write"] = min(best["raw_write"], _timed(lambda: _raw_write(raw_dir, sizes)))  # noqa: B023
        best["raw_read"] = min(best["raw_read"], _timed(lambda: _raw_read(raw_dir)))  # noqa: B023
        buffers = [path.read_bytes() for path in paths]  # the shards' bytes, in memory
        best["checksum"] = min(best["checksum"], _timed(lambda: _checksum(buffers)))  # noqa: B023
        best["consume"] = min(best["consume"], _timed(lambda: _consume(spool_dir, num_shards)))  # noqa: B023
        shutil.rmtree(root / f"{name}-{round_index}")
    _report(name, num_shards, num_bytes, best)


def _report(name: str, num_shards: int, num_bytes: int, best: dict[str, float]) -> None:
    num_samples = num_shards * SAMPLES_PER_SHARD
    mb = num_bytes / 1e6
    print(
        f"\n{name}: {num_shards} shards x {SAMPLES_PER_SHARD} samples, {mb / num_shards:.1f} MB/shard"
    )
    print(f"  raw write+fsync {mb / best['raw_write']:9.0f} MB/s")
    print(f"  raw read        {mb / best['raw_read']:9.0f} MB/s")
    rows = (
        ("publish", best["publish"], best["raw_write"], "raw write+fsync"),
        ("claim+read", best["consume"], best["raw_read"], "raw read"),
        (
            "end to end",
            best["publish"] + best["consume"],
            best["raw_write"] + best["raw_read"],
            "raw write+read",
        ),
    )
    for label, seconds, raw_seconds, raw_label in rows:
        print(
            f"  {label:<15} {mb / seconds:9.0f} MB/s {num_samples / seconds:9.0f} samples/s"
            f"   ratio to {raw_label}: {raw_seconds / seconds:.2f}"
        )
    checksum_s = best["checksum"]
    print(
        f"  crc32 checksums {mb / checksum_s:9.0f} MB/s   share of publish "
        f"{checksum_s / best['publish']:.1%}, of claim+read {checksum_s / best['consume']:.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where to write (default: a temp dir)")
    parser.add_argument("--num-shards", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many rounds")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spool-bench-", dir=args.dir))
    try:
        print(f"spool throughput in {root} (best of {args.repeats})")
        run_workload(root, "text 2k tokens", False, args.num_shards, args.repeats)
        run_workload(root, "text + 224x224 image", True, args.num_shards, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
