"""CPU per shard write and read for a grpo_tiny-like text shard (16 groups x 8 samples,
~12 prompt and 8 response tokens each): the spool's per-step encode/decode cost without the
fsyncs, renames and markers around it (those are in ``step_cpu.py``'s ``write_shard``).

Writes the same groups ``--repeats`` times with ``write_shard_file`` (then reads each back
with ``read_shard``), timing each call's process CPU, and prints the median and mean ms per
write and per read, the number of HDF5 datasets in a shard, and the 1-minute load average
before and after. ``--profile`` prints cProfile's top functions of the reads and writes.

    python benchmarks/shard_io.py [--repeats 300] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from relax_hpc.spool import Sample
from relax_hpc.spool.format import read_shard, write_shard_file

GROUPS, GROUP_SIZE, PROMPT_TOKENS, RESPONSE_TOKENS = 16, 8, 12, 8


def make_groups(rng: np.random.Generator) -> list[list[Sample]]:
    groups = []
    for g in range(GROUPS):
        group_id = f"r0-c3-g{g}"
        group = []
        for k in range(GROUP_SIZE):
            num_response = int(rng.integers(2, RESPONSE_TOKENS + 1))
            reward = float(rng.integers(0, 2))
            sample = Sample(
                sample_id=f"{group_id}-{k}",
                group_id=group_id,
                data_index=int(rng.integers(0, 10_000)),
                prompt_token_ids=rng.integers(0, 64, PROMPT_TOKENS, dtype=np.int32),
                response_token_ids=rng.integers(0, 64, num_response, dtype=np.int32),
                loss_mask=np.ones(num_response, np.uint8),
                rollout_logprobs=-rng.random(num_response, dtype=np.float32),
                reward=reward,
                policy_version=41,
                finish_reason="stop",
                reward_details={"correct": reward},
                timings_s={"generate": 0.031},
            )
            group.append(sample)
        groups.append(group)
    return groups


def cpu_ms(call) -> float:
    start = time.process_time()
    call()
    return (time.process_time() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    groups = make_groups(np.random.default_rng(0))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="shard-io-") as tmp:
        paths = [Path(tmp) / f"s{i}.h5" for i in range(args.repeats)]
        profiler = cProfile.Profile() if args.profile else None
        writes, reads = [], []
        for path in paths:
            write = lambda p=path: write_shard_file(p, groups, "rollout-0", 0.0)  # noqa: E731
            read = lambda p=path: read_shard(p)  # noqa: E731
            if profiler:
                profiler.enable()
            writes.append(cpu_ms(write))
            reads.append(cpu_ms(read))
            if profiler:
                profiler.disable()
        with h5py.File(paths[0], "r") as h5:
            datasets = []
            h5.visititems(lambda n, o: datasets.append(n) if isinstance(o, h5py.Dataset) else None)
        size = paths[0].stat().st_size
    print(f"{len(datasets)} datasets, {size} bytes per shard, {args.repeats} shards")
    for name, values in (("write", writes), ("read", reads)):
        print(
            f"{name}: median {statistics.median(values):.2f} ms CPU, "
            f"mean {statistics.fmean(values):.2f}"
        )
    print(f"load (1 min) {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
