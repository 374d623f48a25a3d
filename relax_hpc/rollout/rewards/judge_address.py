"""Where the judge's servers are: one 0600 file per server in the run's rendezvous folder.

``RunPaths.judge_address_file(rank)`` holds ``host``, ``port``, ``token`` (random per server
start, 256 bits), ``instance`` (random per start), ``pid``, ``attempt`` (the job start) and
``rank``. A server writes its file atomically once it listens and deletes it when it stops
(only its own instance's: a restarted server may already have replaced it). Clients read
the files again whenever a call fails, so a restarted judge (new port, new token) is found
without restarting the rollout.

Must not: do network I/O.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from relax_hpc.paths import RunPaths, atomic_write_json, read_json
from relax_hpc.rollout.rewards.protocol import SCORE_PATH

PRIVATE_MODE = 0o600


@dataclass(frozen=True)
class JudgeAddress:
    host: str
    port: int
    token: str
    instance: str
    pid: int
    attempt: str = ""
    rank: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{SCORE_PATH}"


def new_judge_address(host: str, port: int, attempt: str = "", rank: int = 0) -> JudgeAddress:
    """The address of a server starting now: a fresh token and instance."""
    return JudgeAddress(
        host, port, secrets.token_hex(32), secrets.token_hex(8), os.getpid(), attempt, rank
    )


def publish_judge_address(paths: RunPaths, address: JudgeAddress) -> Path:
    paths.rendezvous_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths.judge_rendezvous_dir.mkdir(mode=0o700, exist_ok=True)
    return atomic_write_json(
        paths.judge_address_file(address.rank), asdict(address), mode=PRIVATE_MODE
    )


def withdraw_judge_address(paths: RunPaths, address: JudgeAddress) -> None:
    """Delete this server's file, unless a newer start of the same rank replaced it."""
    path = paths.judge_address_file(address.rank)
    try:
        current = JudgeAddress(**read_json(path))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return
    if current.instance == address.instance:
        path.unlink(missing_ok=True)


def read_judge_addresses(paths: RunPaths) -> list[JudgeAddress]:
    """The servers that said they are up, by rank; unreadable files are skipped."""
    folder = paths.judge_rendezvous_dir
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            found.append(JudgeAddress(**read_json(path)))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            continue  # being replaced right now
    return sorted(found, key=lambda address: address.rank)
