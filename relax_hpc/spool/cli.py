"""Operator CLI: ``python -m relax_hpc.spool RUN_DIR status|ls|inspect SHARD|quarantine|requeue``.

``status`` and ``ls`` read only directory listings and the small status files (shard names
carry their counts), so they are cheap on a busy network filesystem and safe while the
job runs. ``inspect`` opens one shard read-only; with ``--tokenizer`` (a Hugging Face
name or local path) it decodes prompts and responses to text. ``requeue`` moves
quarantined shards back to ``ready/`` after a fix. Must not: claim or delete shards.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from relax_hpc import exitcodes
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool.errors import SpoolError
from relax_hpc.spool.format import read_shard
from relax_hpc.spool.layout import (
    TMP_SUFFIX,
    ShardName,
    SpoolLayout,
    list_names,
    original_name,
)
from relax_hpc.spool.quarantine import list_quarantined, requeue
from relax_hpc.spool.sample import Sample

_STATES = ("ready", "claimed", "consumed", "quarantine")


def _state_dir(layout: SpoolLayout, state: str) -> Path:
    return getattr(layout, f"{state}_dir")


def _shards(layout: SpoolLayout, state: str) -> list[tuple[str, ShardName | None]]:
    names = list_names(_state_dir(layout, state))
    return [(name, ShardName.parse(original_name(name))) for name in names]


def _rate(recent: Sequence[Sequence[float]]) -> float | None:
    """Samples per second between the first and last ``[unix_s, cumulative samples]`` pair."""
    if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
        return None
    return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def status_lines(layout: SpoolLayout, now_s: float) -> list[str]:
    lines = [f"spool {layout.spool_dir}", ""]
    lines.append(f"{'state':<11} {'shards':>7} {'groups':>8} {'samples':>9} {'oldest_age_s':>13}")
    for state in _STATES:
        parsed = [p for _, p in _shards(layout, state) if p is not None]
        num_shards = len(list_names(_state_dir(layout, state)))
        oldest = min((p.created_unix_s for p in parsed), default=None)
        age = None if oldest is None else now_s - oldest
        lines.append(
            f"{state:<11} {num_shards:>7} {sum(p.num_groups for p in parsed):>8} "
            f"{sum(p.num_samples for p in parsed):>9} {_fmt(age):>13}"
        )
    tmp_names = list_names(layout.tmp_dir, suffix=TMP_SUFFIX)
    lines.append(
        f"{'tmp':<11} {len(tmp_names):>7}   (shards being written, or left by dead writers)"
    )
    lines += ["", "ready by policy_version (the oldest in each shard):"]
    by_version: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for _, parsed in _shards(layout, "ready"):
        if parsed is not None:
            by_version[parsed.min_policy_version][0] += 1
            by_version[parsed.min_policy_version][1] += parsed.num_samples
    for version, (num_shards, num_samples) in sorted(by_version.items()):
        lines.append(f"  v{version}: {num_shards} shards, {num_samples} samples")
    return lines + _writer_lines(layout, now_s) + _reader_lines(layout, now_s)


def _writer_lines(layout: SpoolLayout, now_s: float) -> list[str]:
    lines = [
        "",
        f"{'writer':<28} {'shards':>7} {'samples':>9} {'MB':>9} {'last_age_s':>11} {'samples/s':>10}",
    ]
    for name in list_names(layout.writers_dir, suffix=".json"):
        try:
            record = read_json(layout.writers_dir / name)
        except (OSError, ValueError):
            continue
        age = now_s - record.get("last_publish_unix_s", now_s)
        lines.append(
            f"{record.get('writer_id', name):<28} {record.get('num_shards', 0):>7} "
            f"{record.get('num_samples', 0):>9} {record.get('num_bytes', 0) / 1e6:>9.1f} "
            f"{age:>11.1f} {_fmt(_rate(record.get('recent', []))):>10}"
        )
    return lines


def _reader_lines(layout: SpoolLayout, now_s: float) -> list[str]:
    try:
        status = read_json(layout.reader_status_path)
    except (FileNotFoundError, ValueError):
        return ["", "trainer: no reader status yet"]
    counters = status.get("counters", {})
    keys = ("delivered", "stale", "duplicate")
    dropped = ", ".join(f"{k} {counters.get(f'num_{k}_groups', 0)}" for k in keys)
    return [
        "",
        f"trainer: step {status.get('step')} (checkpointed {status.get('checkpointed_step')}), "
        f"updated {now_s - status.get('updated_unix_s', now_s):.1f} s ago",
        f"  groups: {dropped}; quarantined shards {counters.get('num_quarantined_shards', 0)}, "
        f"missing {counters.get('num_missing_shards', 0)}",
        f"  consumption: {_fmt(_rate(status.get('recent', [])))} samples/s over the recent steps",
    ]


def ls_lines(layout: SpoolLayout, now_s: float) -> list[str]:
    lines = [f"{'state':<11} {'groups':>6} {'samples':>7} {'version':>7} {'age_s':>8}  name"]
    for state in _STATES:
        for name, parsed in _shards(layout, state):
            if parsed is None:
                lines.append(f"{state:<11} {'?':>6} {'?':>7} {'?':>7} {'?':>8}  {name}")
                continue
            age = now_s - parsed.created_unix_s
            lines.append(
                f"{state:<11} {parsed.num_groups:>6} {parsed.num_samples:>7} "
                f"v{parsed.min_policy_version:<6} {age:>8.1f}  {name}"
            )
    return lines


def find_shard(layout: SpoolLayout, shard: str) -> Path:
    """A shard by path, or by name (with or without claim prefix) in any state folder."""
    if Path(shard).is_file():
        return Path(shard)
    for state in _STATES:
        for name in list_names(_state_dir(layout, state)):
            if shard in (name, original_name(name)):
                return _state_dir(layout, state) / name
    raise SpoolError(f"no shard named {shard!r} in {layout.spool_dir}")


def _sample_lines(sample: Sample, decode: Callable[[np.ndarray], str] | None) -> list[str]:
    masked = int(len(sample.loss_mask) - int(np.sum(sample.loss_mask)))
    lines = [
        f"  sample {sample.sample_id}  group {sample.group_id}  data_index {sample.data_index}  "
        f"policy_version {sample.policy_version}",
        f"    reward {sample.reward:g} {sample.reward_details}  finish {sample.finish_reason}  "
        f"turns {sample.num_turns}  timings_s {sample.timings_s}",
        f"    tokens: prompt {len(sample.prompt_token_ids)}, response {len(sample.response_token_ids)} "
        f"({masked} masked)",
    ]
    if sample.images:
        lines.append(f"    images: {[tuple(i.shape) for i in sample.images]}")
    if sample.audio:
        lines.append(f"    audio: {[(c.waveform.shape, c.sample_rate_hz) for c in sample.audio]}")
    if sample.media is not None:
        images = [tuple(i.shape) for i in sample.media.images]
        lines.append(f"    group media: images {images}, clips {len(sample.media.audio)}")
    if sample.metadata:
        lines.append(f"    metadata: {sample.metadata}")
    if decode is not None:
        lines.append(f"    prompt: {decode(sample.prompt_token_ids)!r}")
        lines.append(f"    response: {decode(sample.response_token_ids)!r}")
    return lines


def inspect_lines(path: Path, limit: int, decode: Callable[[np.ndarray], str] | None) -> list[str]:
    header, groups = read_shard(path)
    lines = [f"{path}", f"  {header}", f"  file bytes: {path.stat().st_size}"]
    payloads = {id(s.media): s.media for g in groups for s in g if s.media is not None}
    if payloads:
        media_bytes = sum(p.num_bytes for p in payloads.values())
        shared = sum(
            1 for g in groups if g[0].media is not None and len({id(s.media) for s in g}) == 1
        )
        lines.append(
            f"  group media: {shared} groups, {len(payloads) - shared} samples of their own, "
            f"{media_bytes} bytes (once per group or sample)"
        )
    samples = [s for group in groups for s in group]
    for sample in samples[:limit]:
        lines += _sample_lines(sample, decode)
    if len(samples) > limit:
        lines.append(f"  ... {len(samples) - limit} more samples (--limit)")
    return lines


def _decoder(tokenizer: str | None) -> Callable[[np.ndarray], str] | None:
    if tokenizer is None:
        return None
    from transformers import AutoTokenizer  # heavy; only when asked to decode

    loaded = AutoTokenizer.from_pretrained(tokenizer)
    return lambda ids: loaded.decode(np.asarray(ids).tolist())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.spool", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", type=Path, help="the run directory")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status", help="counts per state and policy version, ages, throughput")
    commands.add_parser("ls", help="every shard with its state")
    inspect = commands.add_parser("inspect", help="print a shard's samples")
    inspect.add_argument("shard", help="shard name (any state) or path")
    inspect.add_argument("--limit", type=int, default=8, help="samples to print")
    inspect.add_argument("--tokenizer", help="HF tokenizer name or path to decode tokens to text")
    commands.add_parser("quarantine", help="quarantined shards and why")
    requeue_cmd = commands.add_parser("requeue", help="return quarantined shards to ready/")
    requeue_cmd.add_argument("shards", nargs="*", help="names to requeue")
    requeue_cmd.add_argument("--all", action="store_true", help="requeue every quarantined shard")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    layout = SpoolLayout(RunPaths(args.run_dir).spool_dir)
    if not layout.spool_dir.is_dir():
        print(f"error: no spool at {layout.spool_dir}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    now_s = time.time()
    try:
        if args.command == "status":
            lines = status_lines(layout, now_s)
        elif args.command == "ls":
            lines = ls_lines(layout, now_s)
        elif args.command == "inspect":
            lines = inspect_lines(
                find_shard(layout, args.shard), args.limit, _decoder(args.tokenizer)
            )
        elif args.command == "quarantine":
            lines = [f"{q.name}\n    {q.reason}" for q in list_quarantined(layout)] or ["(none)"]
        else:
            if not args.shards and not args.all:
                print("error: name shards to requeue, or pass --all", file=sys.stderr)
                return exitcodes.CONFIG_ERROR
            lines = [f"requeued {n}" for n in requeue(layout, None if args.all else args.shards)]
    except (SpoolError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return exitcodes.FAILED
    print("\n".join(lines))
    return 0
