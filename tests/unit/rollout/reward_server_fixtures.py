"""A real reward endpoint on loopback whose next answers a test scripts.

It speaks ``relax_hpc.reward/1`` (the score of an item is the length of its response) and
can, request by request: answer (``ok``), answer 500 (``error``), answer late (``slow``),
answer bytes that are not JSON (``garbage``), JSON of another shape (``wrong_shape``),
close the connection without answering (``drop``), refuse (``unauthorized``), or answer
500 with the request's Authorization header in the body (``echo_auth``: a server that
leaks what it was sent, to show that the client masks it).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedRewardServer:
    def __init__(self, token: str | None = None, slow_s: float = 2.0) -> None:
        self.token = token
        self.slow_s = slow_s
        self.script: deque[str] = deque()
        self.requests: list[dict] = []  # {"behaviour", "authorization", "ids"}
        self.lock = threading.Lock()

    def then(self, *behaviours: str) -> ScriptedRewardServer:
        self.script.extend(behaviours)
        return self

    def start(self) -> ScriptedRewardServer:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/score?tenant=lab"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def next_behaviour(self) -> str:
        with self.lock:
            return self.script.popleft() if self.script else "ok"

    def answered(self, behaviour: str = "ok") -> int:
        return sum(1 for r in self.requests if r["behaviour"] == behaviour)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _handler(owner: ScriptedRewardServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            behaviour = owner.next_behaviour()
            authorization = self.headers.get("Authorization")
            ids = [item["id"] for item in body["items"]]
            owner.requests.append(
                {"behaviour": behaviour, "authorization": authorization, "ids": ids}
            )
            if owner.token and authorization != f"Bearer {owner.token}":
                behaviour = "unauthorized"
            if behaviour == "drop":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if behaviour == "slow":
                time.sleep(owner.slow_s)
            status, payload = _answer(behaviour, body, authorization)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a client that timed out has gone: what "slow" is for

        def log_message(self, *args):
            pass

    return Handler


def _answer(behaviour: str, body: dict, authorization: str | None) -> tuple[int, bytes]:
    if behaviour == "error":
        return 500, b'{"error": "model server crashed"}'
    if behaviour == "unauthorized":
        return 401, b'{"error": "bad token"}'
    if behaviour == "echo_auth":
        return 500, f"upstream failed for request with Authorization: {authorization}".encode()
    if behaviour == "garbage":
        return 200, b"<html>502 Bad Gateway</html>"
    if behaviour == "wrong_shape":
        return 200, b'{"scores": [1, 2, 3]}'
    results = [
        {"id": item["id"], "score": float(len(item["response"])), "details": {"by": "sink"}}
        for item in body["items"]
    ]
    return 200, json.dumps({"protocol": "relax_hpc.reward/1", "results": results}).encode()
