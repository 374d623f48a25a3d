"""Peers without the run's token, as a separate process: what an adversary on the node can
send through the weight-sync interfaces (the rendezvous folder, the trainer's store, its
liveness port). Run as ``python weightsync_intruders.py ACTION ROOT HOST PORT INSTANCE
VICTIM [LIVENESS_PORT]``; prints one JSON line with what it saw, exits 0.

* ``wrong_token``: a new incarnation under the victim's engine id, proving a wrong token.
* ``replay``: the victim's hello proof, copied from the store, presented (1) for a new
  incarnation under the victim's id and (2) under the victim's own member id (its
  registration file rewritten with the intruder's pid, then removed again).
* ``truncated``: a hello proof cut in half, a registration file cut in half, and, when the
  trainer has a liveness port, a liveness handshake that stops mid-line and one that
  claims the victim with a wrong proof.
* ``flood``: ``FLOOD_REGISTRATIONS`` registrations with wrong tokens and
  ``FLOOD_CONNECTIONS`` idle connections to the liveness port, held until told to stop
  (``ROOT/test_status/stop_flood``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

from torch._C._distributed_c10d import PrefixStore, TCPStore

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import rendezvous
from relax_hpc.weightsync.group import STORE_PREFIX

WRONG_TOKEN = "0" * 64
FLOOD_REGISTRATIONS = 100
FLOOD_CONNECTIONS = 200


def _registration(engine_id: str, incarnation: str, instance: str) -> rendezvous.EngineRegistration:
    return rendezvous.EngineRegistration(
        engine_id, incarnation, instance, socket.gethostname(), os.getpid()
    )


def _answer(store, member: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not store.check([f"admission/{member}"]):
        if time.monotonic() > deadline:
            return {"ok": None, "reason": "no answer"}
        time.sleep(0.02)
    return json.loads(store.get(f"admission/{member}"))


def _hello(store, paths: RunPaths, reg: rendezvous.EngineRegistration, proof: str) -> dict:
    """The engine's handshake (hello, then the file), answered by the trainer."""
    store.set(f"hello/{reg.member_id}", proof)
    rendezvous.register_engine(paths, reg)
    return _answer(store, reg.member_id)


def wrong_token(store, paths, instance, victim, _liveness_port) -> dict:
    reg = _registration(victim.split(".")[0], rendezvous.new_nonce(), instance)
    return {"answer": _hello(store, paths, reg, rendezvous.hello_proof(WRONG_TOKEN, reg.member_id))}


def replay(store, paths, instance, victim, _liveness_port) -> dict:
    engine_id, incarnation = victim.split(".")
    stolen = store.get(f"hello/{victim}").decode()
    fresh = _registration(engine_id, rendezvous.new_nonce(), instance)
    as_new = _hello(store, paths, fresh, stolen)
    same = _registration(engine_id, incarnation, instance)  # the victim's own member id
    store.set(f"hello/{victim}", stolen)
    rendezvous.register_engine(paths, same)
    time.sleep(1.0)  # the trainer looks at registrations at its next sync
    rendezvous.deregister_engine(paths, same)
    return {"as_new": as_new}


def truncated(store, paths, instance, victim, liveness_port) -> dict:
    engine_id = victim.split(".")[0]
    reg = _registration(engine_id, rendezvous.new_nonce(), instance)
    proof = rendezvous.hello_proof(WRONG_TOKEN, reg.member_id)
    half_hello = _hello(store, paths, reg, proof[: len(proof) // 2])
    cut = _registration("cut", rendezvous.new_nonce(), instance)
    text = json.dumps(cut.__dict__)
    rendezvous.engines_dir(paths).joinpath(f"{cut.member_id}.json").write_text(text[:20])
    closed = {}
    if liveness_port:
        stalled = socket.create_connection(("127.0.0.1", liveness_port))
        stalled.recv(64)
        stalled.sendall(f"{victim} {proof[:10]}".encode())  # no newline, then silence
        forged = socket.create_connection(("127.0.0.1", liveness_port))
        forged.recv(64)
        forged.sendall(f"{victim} {proof}\n".encode())
        closed = {"forged": forged.recv(64) == b"", "stalled": stalled.recv(64) == b""}
    return {"half_hello": half_hello, "liveness_closed": closed}


def flood(store, paths, instance, victim, liveness_port) -> dict:
    for index in range(FLOOD_REGISTRATIONS):
        reg = _registration(f"flood{index}", rendezvous.new_nonce(), instance)
        store.set(f"hello/{reg.member_id}", rendezvous.hello_proof(WRONG_TOKEN, reg.member_id))
        rendezvous.register_engine(paths, reg)
    connections = []
    for _ in range(FLOOD_CONNECTIONS if liveness_port else 0):
        try:
            connections.append(socket.create_connection(("127.0.0.1", liveness_port), timeout=5))
        except OSError:
            break
    print(json.dumps({"flooding": len(connections)}), flush=True)
    stop = Path(paths.root) / "test_status" / "stop_flood"
    while not stop.exists():
        time.sleep(0.05)
    return {"connections": len(connections)}


if __name__ == "__main__":
    action, root, host, port, instance, victim = sys.argv[1:7]
    liveness = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    client = TCPStore(host, int(port), None, False, timedelta(seconds=60))
    actions = {"wrong_token": wrong_token, "replay": replay, "truncated": truncated}
    actions["flood"] = flood
    seen = actions[action](
        PrefixStore(STORE_PREFIX, client), RunPaths(Path(root)), instance, victim, liveness
    )
    print(json.dumps(seen), flush=True)
