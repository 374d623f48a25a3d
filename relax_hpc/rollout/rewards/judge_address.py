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

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.address_files import PRIVATE_DIR_MODE, publish_record, read_record, read_records
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.rewards.protocol import SCORE_PATH


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
    paths.rendezvous_dir.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    return publish_record(paths.judge_address_file(address.rank), address)


def withdraw_judge_address(paths: RunPaths, address: JudgeAddress) -> None:
    """Delete this server's file, unless a newer start of the same rank replaced it."""
    path = paths.judge_address_file(address.rank)
    current = read_record(path, JudgeAddress)
    if current is not None and current.instance == address.instance:
        path.unlink(missing_ok=True)


def read_judge_addresses(paths: RunPaths) -> list[JudgeAddress]:
    """The servers that said they are up, by rank; unreadable files are skipped."""
    found = [address for _, address in read_records(paths.judge_rendezvous_dir, JudgeAddress)]
    return sorted(found, key=lambda address: address.rank)
