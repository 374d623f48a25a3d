"""Fixtures shared by the unit tests: a clock moved by hand and a stand-in for SGLang."""

from __future__ import annotations

import asyncio

import pytest

from relax_hpc.rollout.engines.sglang_engine import SGLangEngine


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

        kwargs = {"tensor_parallel": 2, "mem_fraction": 0.7, "seeded": True, **engine_kwargs}
        engine = SGLangEngine("/models/qwen3", launch=launch, **kwargs)
        return engine, made[0]

    return make
