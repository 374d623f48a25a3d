"""Shared fixtures. Tests import the package from the checkout (editable install)."""

from __future__ import annotations

import asyncio

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tests run on 2 shared cores; one intra-op thread keeps parallel processes fair."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests are skipped, with a reason, where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); run on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class SmtpSink:
    """A real SMTP server (aiosmtpd) on loopback that requires AUTH with one password."""

    def __init__(self) -> None:
        import secrets

        self.user = "relax-ops"
        self.password = f"smtp-pw-{secrets.token_hex(8)}"
        self.messages: list = []

    def start(self) -> SmtpSink:
        import email
        import socket

        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import AuthResult

        sink = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                sink.messages.append(email.message_from_bytes(envelope.original_content))
                return "250 OK"

        def authenticate(server, session, envelope, mechanism, auth_data):
            ok = (
                auth_data.login == sink.user.encode()
                and auth_data.password == sink.password.encode()
            )
            return AuthResult(success=ok)

        with socket.socket() as probe:  # aiosmtpd needs a concrete port to test-connect to
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.controller = Controller(
            Handler(),
            hostname="127.0.0.1",
            port=self.port,
            auth_require_tls=False,
            authenticator=authenticate,
        )
        self.controller.start()
        return self

    @property
    def url(self) -> str:
        return (
            f"mailto://{self.user}:{self.password}@127.0.0.1:{self.port}"
            "?from=relax@example.test&to=ops@example.test&mode=insecure"
        )

    def subjects(self) -> list[str]:
        return [str(m["Subject"]) for m in self.messages]

    def body(self, subject_part: str) -> str:
        message = next(m for m in self.messages if subject_part in str(m["Subject"]))
        part = next(p for p in message.walk() if p.get_content_type() == "text/plain")
        return part.get_payload(decode=True).decode()


class WebhookSink:
    """A JSON webhook endpoint on loopback (what Apprise's json:// posts to)."""

    def __init__(self) -> None:
        import secrets

        self.token = f"hook-token-{secrets.token_hex(8)}"
        self.posts: list[tuple[dict, dict]] = []  # (headers, JSON body)

    def start(self) -> WebhookSink:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.posts.append((dict(self.headers), json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"json://127.0.0.1:{self.server.server_port}/relax-hook?+X-Relax-Token={self.token}"

    def titles(self) -> list[str]:
        return [body["title"] for _, body in self.posts]

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def smtp_sink():
    sink = SmtpSink().start()
    yield sink
    sink.controller.stop()


@pytest.fixture(scope="module")
def webhook_sink():
    sink = WebhookSink().start()
    yield sink
    sink.stop()


@pytest.fixture
def its_run(request, result_of):
    """(run_dir, result) of this test's run, from its module's ``result_of`` fixture
    (``e2e_helpers.runs_of_selected_tests``)."""
    return result_of(request.node.originalname)


def cut_short_copy(folder, broken):
    """``broken``: a copy of the model ``folder`` whose weights file was cut short (a bad copy)."""
    import shutil

    shutil.copytree(folder, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    return broken


@pytest.fixture
def broken_model_folder(transformers5_folder, tmp_path):
    """A copy of the transformers 5 folder whose weights file was cut short."""
    return cut_short_copy(transformers5_folder[0], tmp_path / "broken-model")


@pytest.fixture(scope="session")
def transformers5_folder(tmp_path_factory):
    """(folder, model as saved, tokenizer as saved) of ``write_transformers5_folder``."""
    folder = tmp_path_factory.mktemp("transformers5") / "tiny-qwen3"
    folder.mkdir()
    from tiny_models import write_transformers5_folder

    model, tokenizer = write_transformers5_folder(folder)
    return folder, model, tokenizer


class FakeClock:
    """A clock tests move by hand: ``clock.now += 60``."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_clock():
    """``clock = fake_clock()`` (or ``fake_clock(now=0.0)``)."""
    return FakeClock


# --- a stand-in for sglang.Engine (SGLang needs CUDA) ---------------------------------------------
class StandInTokenizerManager:
    def __init__(self) -> None:
        self.aborted: list[bool] = []
        self.paused: list[bool] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(abort_all)

    async def pause_generation(self, *request) -> None:
        self.paused.append(True)

    async def continue_generation(self, *request) -> None:
        self.paused.append(False)


class StandInLoop:
    def is_running(self) -> bool:
        return False  # no generate() in flight: the abort runs directly

    def run_until_complete(self, coroutine):
        return asyncio.run(coroutine)


class StandInSGLang:
    """Answers like ``sglang.Engine``; ``results`` scripts the control calls' replies."""

    def __init__(self, outputs: list[dict], **server_args) -> None:
        self.server_args = server_args
        self.outputs = outputs
        self.calls: list[tuple[str, dict]] = []
        self.results: dict[str, object] = {}
        self.tokenizer_manager = StandInTokenizerManager()
        self.loop = StandInLoop()

    def generate(self, **kwargs):
        self.calls.append(("generate", kwargs))
        return self.outputs

    def __getattr__(self, name: str):
        def call(**kwargs):
            self.calls.append((name, kwargs))
            return self.results.get(name, (True, "ok", 0))

        return call


@pytest.fixture
def sglang_stand_in():
    """``engine, sglang = sglang_stand_in(outputs, **SGLangEngine kwargs)``: an ``SGLangEngine``
    over a ``StandInSGLang`` that answers ``generate`` with ``outputs``; ``sglang.calls``
    records every call, ``sglang.results`` scripts the control calls' replies."""

    def make(outputs: list[dict] | None = None, **engine_kwargs):
        made: list[StandInSGLang] = []

        def launch(**server_args) -> StandInSGLang:
            made.append(StandInSGLang(outputs or [], **server_args))
            return made[-1]

        from relax_hpc.rollout.engines.sglang_engine import SGLangEngine

        kwargs = {"tensor_parallel": 2, "mem_fraction": 0.7, "seeded": True, **engine_kwargs}
        engine = SGLangEngine("/models/qwen3", launch=launch, **kwargs)
        return engine, made[0]

    return make
