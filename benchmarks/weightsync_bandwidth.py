"""Weight-sync throughput vs a raw Gloo broadcast, and end-to-end sync latency, on loopback.

For 1 and 2 receiver processes, in the same run and the same processes:

- raw: ``ProcessGroupGloo.broadcast`` of one flat uint8 tensor of N bytes (best of repeats);
- sync: ``WeightSender.sync`` of a transformers Llama state dict of the same N bytes on the
  wire (``--serve-dtype float32`` by default, so no conversion changes the byte count).
  ``broadcast`` = pack + checksum + send (the bucket pipeline); ``end-to-end`` = the whole
  ``sync``: round handshake, broadcast, receiver verification, load into the receiver's
  ``LlamaForCausalLM``, results.

Prints ``ratio = raw_seconds / sync_broadcast_seconds`` (goal >= 0.8) per receiver count.
Usage: ``python benchmarks/weightsync_bandwidth.py [--size-mb 512] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import WeightReceiver, WeightSender, WeightSyncConfig, module_loader

HOST = "127.0.0.1"
TIMEOUT_S = 120.0


def build_model(size_mb: int):
    """A Llama whose fp32 parameters take about ``size_mb`` MB."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, vocab = 1024, 2816, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate
    fixed = 2 * vocab * hidden
    layers = max(1, round((size_mb * 1e6 / 4 - fixed) / per_layer))
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def raw_group(port: int, rank: int, world_size: int) -> ProcessGroupGloo:
    store = TCPStore(
        HOST, port, None, rank == 0, timedelta(seconds=TIMEOUT_S), wait_for_workers=False
    )
    return ProcessGroupGloo(
        PrefixStore("raw", store), rank, world_size, timedelta(seconds=TIMEOUT_S)
    )


def raw_broadcast(group: ProcessGroupGloo, flat: torch.Tensor) -> float:
    options = BroadcastOptions()
    options.rootRank = 0
    start = time.perf_counter()
    group.broadcast([flat], options).wait()
    return time.perf_counter() - start


def receiver_main(root: str, engine_id: str, rank: int, world_size: int, args) -> None:
    torch.set_num_threads(1)
    model = build_model(args.size_mb)
    group = raw_group(args.raw_port, rank, world_size)
    flat = torch.empty(args.num_bytes, dtype=torch.uint8)
    for _ in range(args.repeats + 1):
        raw_broadcast(group, flat)
    del group, flat
    config = _config(args)
    receiver = WeightReceiver(RunPaths(root), engine_id, config)
    receiver.join()
    stop = Path(root) / "stop"
    loader = module_loader(model)
    while not stop.exists():
        receiver.poll_for_update(loader, wait_s=0.2)
    receiver.close()


def _config(args) -> WeightSyncConfig:
    return WeightSyncConfig(
        backend="gloo",
        timeout_s=TIMEOUT_S,
        bucket_mb=args.bucket_mb,
        serve_dtype=args.serve_dtype,
        fs_fallback=False,
        advertise_host=HOST,
        poll_s=0.005,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def measure(num_receivers: int, state: dict[str, torch.Tensor], args) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="weightsync_bench_")
    paths = RunPaths(root).create()
    sender = WeightSender(paths, _config(args), "cpu")
    sender.start()
    args.num_bytes = sender._layout_for(list(state.items())).total_nbytes
    args.raw_port = _free_port()
    context = mp.get_context("spawn")
    workers = [
        context.Process(target=receiver_main, args=(root, f"r{i}", i + 1, num_receivers + 1, args))
        for i in range(num_receivers)
    ]
    for worker in workers:
        worker.start()
    group = raw_group(args.raw_port, 0, num_receivers + 1)
    flat = torch.ones(args.num_bytes, dtype=torch.uint8)
    raw_s = min(raw_broadcast(group, flat) for _ in range(args.repeats + 1))
    del group, flat
    deadline = time.monotonic() + TIMEOUT_S
    while len(sender.admitted_engines) < num_receivers and time.monotonic() < deadline:
        sender.admit_pending()
        time.sleep(0.05)
    reports = [sender.sync(state, version) for version in range(1, args.repeats + 2)]
    assert all(len(r.members) == num_receivers for r in reports), reports
    (Path(root) / "stop").touch()
    for worker in workers:
        worker.join(TIMEOUT_S)
    sender.close()
    steady = reports[1:]  # the first sync also forms the group
    return {
        "raw_s": raw_s,
        "broadcast_s": min(r.broadcast_seconds for r in steady),
        "end_to_end_s": min(r.seconds for r in steady),
        "first_sync_s": reports[0].seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512, help="fp32 model size (MB)")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--serve-dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = build_model(args.size_mb).state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"state dict: {len(state)} tensors, {nbytes / 1e9:.3f} GB fp32, serve {args.serve_dtype}, "
          f"buckets {args.bucket_mb} MiB, {torch.get_num_threads()} thread(s), {mp.cpu_count()} cores")  # fmt: skip
    for num_receivers in args.receivers:
        result = measure(num_receivers, state, args)
        gb = args.num_bytes / 1e9
        print(
            f"receivers={num_receivers}: raw gloo {gb / result['raw_s']:.2f} GB/s | "
            f"weightsync broadcast {gb / result['broadcast_s']:.2f} GB/s | "
            f"ratio {result['raw_s'] / result['broadcast_s']:.2f} (goal >= 0.8) | "
            f"end-to-end sync {result['end_to_end_s']:.3f} s "
            f"(ratio {result['raw_s'] / result['end_to_end_s']:.2f}) | "
            f"first sync incl. group formation {result['first_sync_s']:.3f} s"
        )


if __name__ == "__main__":
    main()
