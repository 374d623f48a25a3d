"""Fixtures of the reward-service tests (unit, dist, e2e, gpu), importable from any of them.

``ScriptedRewardServer``: a real reward endpoint on loopback whose next answers a test
scripts. ``train_yes_judge``: a tiny judge that answers "yes" to additions, trained in a
second. ``save_tiny_reward_model``: a tiny sequence-classification model folder.

The scripted endpoint
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

import torch
import transformers
from tiny_models import tiny_qwen3, tiny_qwen3_arch

from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.tasks.warm_start import supervised_batch

TINY_ARCH = tiny_qwen3_arch(num_hidden_layers=1, max_position_embeddings=48)


def train_yes_judge(arch: dict = TINY_ARCH, steps: int = 25, lr: float = 2e-2):
    """(model, tokenizer): a few supervised steps until it answers "yes" to additions."""
    model, tokenizer = tiny_qwen3(arch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    texts = [f"{a}+{b}={a + b}?" for a, b in [(1, 2), (13, 9), (40, 2), (7, 77)]]
    input_ids, labels = supervised_batch(tokenizer, texts, ["yes"] * len(texts))
    model.train()
    for _ in range(steps):
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer


def save_tiny_reward_model(folder, num_labels: int = 1) -> None:
    """A random Qwen3 sequence-classification model with the char tokenizer, saved."""
    tokenizer = build_char_tokenizer()
    config = transformers.Qwen3Config(
        **tiny_qwen3_arch(num_hidden_layers=1),
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        num_labels=num_labels,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForSequenceClassification(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


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
