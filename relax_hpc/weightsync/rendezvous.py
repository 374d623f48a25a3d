"""Rendezvous files in ``RunPaths.rendezvous_dir`` and the token-based admission proofs.

Layout of the rendezvous directory (created 0700 by ``RunPaths.create``):

- ``trainer.json`` (mode 0600, written atomically by the trainer): ``host``, ``port`` of the
  trainer's TCPStore, the per-run ``token`` (random, 256 bits; kept across requeues of the
  same run directory), ``instance`` (random per trainer start), ``pid``, ``attempt``
  (the job start it belongs to, e.g. ``<jobid>.<restart>``: engines of a requeued job wait
  for their own start's file, or a later one's, instead of dialling the dead address of
  the previous one) and
  ``liveness_port`` (see ``liveness``).
- ``engines/<engine_id>.<incarnation>.json`` (mode 0600, one per engine process, written by
  it and deleted only by it): ``engine_id``, ``incarnation`` (random per join),
  ``trainer_instance`` it said hello to, ``host``, ``pid``. Keyed by the whole member id, so
  no other registration, admitted or not, can replace or remove an engine's file.

What the token does and does not protect:

- Admission: an engine proves it knows the token by putting
  ``HMAC-SHA256(token, "hello|<engine_id>|<incarnation>")`` in the store; the trainer
  answers with ``HMAC(token, "admit|...")`` so the engine also knows it reached the real
  trainer of this run. Peers without the token (another run's engines, a stale or mistyped
  run directory, another user's processes, which cannot read the 0600 file) are refused
  and are never part of a broadcast group. Admission is decided before identity: the proof
  is checked first, and only a proven engine's id is looked at (a second proven engine
  with the id of a live one is refused too). Nothing a refused peer does changes the
  state of an admitted engine.
- Every message of a round is signed with the token and names its round and member
  (``sign_message``/``open_message``): the trainer's call, plan, digest and drop notices,
  the engines' ready and result messages. A receiver rejects metadata that did not come
  from a holder of the token; the trainer ignores a ready or result it cannot verify.
- Not protected: the TCPStore and the Gloo/NCCL connections themselves are
  unauthenticated and unencrypted (torch offers nothing else). Anyone who can reach the
  store port can read keys (never the token: only HMACs travel), delete or overwrite keys,
  and so disrupt a round (denial of service) or, with effort, race the group formation. The
  bucket checksums are signed but are not MACs: an attacker able to inject bytes into a
  Gloo/NCCL stream could craft data matching a signed CRC-32. Run on a trusted cluster
  network; the token is an admission and misconfiguration guard, not transport security.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.address_files import publish_record, read_records
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.signing import hmac_hex, hmac_matches
from relax_hpc.weightsync.errors import WeightSyncTimeout
from relax_hpc.weightsync.protocol import canonical_bytes

TRAINER_FILE = "trainer.json"
ENGINES_DIR = "engines"


@dataclass(frozen=True)
class TrainerEndpoint:
    host: str
    port: int
    token: str
    instance: str
    pid: int
    attempt: str = ""
    liveness_port: int = 0  # 0: none (a trainer of an older version)


@dataclass(frozen=True)
class EngineRegistration:
    engine_id: str
    incarnation: str
    trainer_instance: str
    host: str
    pid: int

    @property
    def member_id(self) -> str:
        """Identity of this engine process within groups: a restarted engine is a new member."""
        return f"{self.engine_id}.{self.incarnation}"


def new_token() -> str:
    return secrets.token_hex(32)


def new_nonce() -> str:
    return secrets.token_hex(8)


def default_host() -> str:
    return socket.getfqdn()


def sign(token: str, message: bytes) -> str:
    return hmac_hex(token, message)


def verify_signature(token: str, message: bytes, signature: str) -> bool:
    return hmac_matches(token, message, signature)


def hello_proof(token: str, member_id: str) -> str:
    return sign(token, f"hello|{member_id}".encode())


def admit_proof(token: str, member_id: str) -> str:
    return sign(token, f"admit|{member_id}".encode())


def sign_message(token: str, body: dict) -> str:
    """A store value: ``body`` and its HMAC; bodies name their round (and member) so that a
    value copied to another key or round does not verify there."""
    return json.dumps({"body": body, "sig": sign(token, canonical_bytes(body))})


def open_message(token: str, value: bytes | str, **expected: object) -> dict | None:
    """The body of a ``sign_message`` value whose signature and ``expected`` fields match;
    None for anything else (forged, truncated, replayed from another key)."""
    try:
        message = json.loads(value)
        body, signature = message["body"], message["sig"]
        authentic = verify_signature(token, canonical_bytes(body), signature)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not authentic or any(body.get(k) != v for k, v in expected.items()):
        return None
    return body


def trainer_file(paths: RunPaths) -> Path:
    return paths.rendezvous_dir / TRAINER_FILE


def engines_dir(paths: RunPaths) -> Path:
    return paths.rendezvous_dir / ENGINES_DIR


def existing_token(paths: RunPaths) -> str | None:
    """The token of an earlier start of this run (requeue), so running engines stay valid."""
    endpoint = read_trainer_endpoint(paths)
    return endpoint.token if endpoint else None


def publish_trainer_endpoint(paths: RunPaths, endpoint: TrainerEndpoint) -> Path:
    return publish_record(trainer_file(paths), endpoint)


def read_trainer_endpoint(paths: RunPaths) -> TrainerEndpoint | None:
    path = trainer_file(paths)
    if not path.exists():
        return None
    return TrainerEndpoint(**read_json(path))


def wait_for_trainer_endpoint(
    paths: RunPaths, timeout_s: float, poll_s: float, attempt: str = ""
) -> TrainerEndpoint:
    """The trainer's endpoint; with ``attempt``, only one published by that job start or a
    later start of the same job (the trainer restarted alone while this rollout task ran
    on: ``launch/local.py``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        endpoint = read_trainer_endpoint(paths)
        if endpoint is not None and (not attempt or same_or_later_start(endpoint.attempt, attempt)):
            return endpoint
        if time.monotonic() >= deadline:
            found = f" (found one of start {endpoint.attempt!r})" if endpoint else ""
            raise WeightSyncTimeout(
                f"no trainer rendezvous file {trainer_file(paths)} of start {attempt!r} "
                f"after {timeout_s:.1f} s{found}"
            )
        time.sleep(poll_s)


def same_or_later_start(found: str, wanted: str) -> bool:
    """``found`` (``<job id>.<restart>``) is the start ``wanted`` or a later one of its job;
    an earlier start's file names a trainer that is gone."""
    if found == wanted:
        return True
    found_job, _, found_restart = found.rpartition(".")
    wanted_job, _, wanted_restart = wanted.rpartition(".")
    if not (found_restart.isdigit() and wanted_restart.isdigit()) or found_job != wanted_job:
        return False
    return int(found_restart) >= int(wanted_restart)


def registration_path(paths: RunPaths, registration: EngineRegistration) -> Path:
    return engines_dir(paths) / f"{registration.member_id}.json"


def register_engine(paths: RunPaths, registration: EngineRegistration) -> Path:
    return publish_record(registration_path(paths, registration), registration)


def deregister_engine(paths: RunPaths, registration: EngineRegistration) -> None:
    """Remove this engine process's own file (no other engine's)."""
    registration_path(paths, registration).unlink(missing_ok=True)


def list_engine_registrations(paths: RunPaths) -> list[EngineRegistration]:
    """Current registration files, sorted by engine id; unreadable files are skipped."""
    registrations = [
        registration
        for path, registration in read_records(engines_dir(paths), EngineRegistration)
        if path.name == f"{registration.member_id}.json"  # a file under another's name: no
    ]
    return sorted(registrations, key=lambda reg: (reg.engine_id, reg.incarnation))
