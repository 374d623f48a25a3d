"""Filesystem export of policy weights: ``weights/v{N}/`` as safetensors, atomically.

Used for joiners (they load the latest version before their first broadcast), for
debugging, and as the fallback when no network group can be formed. Layout:

- ``weights/v{N}/model.safetensors``: the tensors in the serving dtype; the safetensors
  header metadata carries ``policy_version``.
- ``weights/v{N}/manifest.json``: ``policy_version``, ``num_bytes``, ``crc32`` of the
  safetensors file, ``num_tensors``.
- ``weights/latest.json``: ``{"policy_version": N}``, replaced atomically after v{N} exists.

A version folder appears by a single ``rename`` of a complete temp folder, so a reader
sees a whole version or none. Only the trainer (the owner) writes and prunes; it keeps
the newest ``keep_versions`` folders. Must not import anything from the network side.
"""

from __future__ import annotations

import os
import secrets
import shutil
import zlib
from pathlib import Path

import safetensors.torch
import torch

from relax_hpc.paths import RunPaths, atomic_write_json, fsync_dir, fsync_file, read_json
from relax_hpc.weightsync.errors import WeightVerificationError
from relax_hpc.weightsync.protocol import NamedTensors, as_named_list, serve_dtype_of

WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest.json"


def publish_weights(
    paths: RunPaths,
    named_tensors: NamedTensors,
    policy_version: int,
    serve_dtype: torch.dtype | None = None,
    keep_versions: int = 2,
) -> Path:
    """Write ``weights/v{policy_version}/`` (idempotent) and point ``latest.json`` at it."""
    final_dir = paths.weights_version_dir(policy_version)
    if not final_dir.exists():
        _write_version_dir(paths, final_dir, named_tensors, policy_version, serve_dtype)
    latest = latest_published_version(paths)
    if latest is None or latest < policy_version:
        atomic_write_json(paths.weights_dir / LATEST_FILE, {"policy_version": policy_version})
    prune_published(paths, keep_versions)
    return final_dir


def _write_version_dir(
    paths: RunPaths,
    final_dir: Path,
    named_tensors: NamedTensors,
    policy_version: int,
    serve_dtype: torch.dtype | None,
) -> None:
    tensors = {
        # a private contiguous CPU copy: safetensors refuses shared storage (tied weights)
        name: tensor.to("cpu", serve_dtype_of(tensor.dtype, serve_dtype), copy=True).contiguous()
        for name, tensor in as_named_list(named_tensors)
    }
    data = safetensors.torch.save(tensors, metadata={"policy_version": str(policy_version)})
    tmp_dir = paths.weights_dir / f".{final_dir.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp_dir.mkdir(parents=True)
    try:
        (tmp_dir / WEIGHTS_FILE).write_bytes(data)
        fsync_file(tmp_dir / WEIGHTS_FILE)
        manifest = {
            "policy_version": policy_version,
            "num_bytes": len(data),
            "num_tensors": len(tensors),
            "crc32": zlib.crc32(data),
        }
        atomic_write_json(tmp_dir / MANIFEST_FILE, manifest)
        os.rename(tmp_dir, final_dir)  # atomic; fails if another writer got there first
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    fsync_dir(paths.weights_dir)


def latest_published_version(paths: RunPaths) -> int | None:
    path = paths.weights_dir / LATEST_FILE
    if not path.exists():
        return None
    return int(read_json(path)["policy_version"])


def published_versions(paths: RunPaths) -> list[int]:
    if not paths.weights_dir.is_dir():
        return []
    versions = []
    for entry in paths.weights_dir.iterdir():
        if entry.is_dir() and entry.name.startswith("v") and entry.name[1:].isdigit():
            versions.append(int(entry.name[1:]))
    return sorted(versions)


def prune_published(paths: RunPaths, keep_versions: int) -> list[int]:
    """Delete all but the newest ``keep_versions`` version folders; return the deleted ones."""
    doomed = published_versions(paths)[:-keep_versions]
    for version in doomed:
        shutil.rmtree(paths.weights_version_dir(version), ignore_errors=True)
    return doomed


def load_published_weights(
    paths: RunPaths, policy_version: int | None = None, device: str | torch.device = "cpu"
) -> tuple[int, dict[str, torch.Tensor]]:
    """Read and verify one published version (default: the latest).

    Raises ``FileNotFoundError`` when nothing is published and ``WeightVerificationError``
    when the file does not match its manifest.
    """
    if policy_version is None:
        policy_version = latest_published_version(paths)
        if policy_version is None:
            raise FileNotFoundError(f"no published weights under {paths.weights_dir}")
    version_dir = paths.weights_version_dir(policy_version)
    manifest = read_json(version_dir / MANIFEST_FILE)
    data = (version_dir / WEIGHTS_FILE).read_bytes()
    if len(data) != manifest["num_bytes"] or zlib.crc32(data) != manifest["crc32"]:
        raise WeightVerificationError(f"{version_dir / WEIGHTS_FILE} does not match its manifest")
    tensors = safetensors.torch.load(data)
    return policy_version, {name: tensor.to(device) for name, tensor in tensors.items()}
