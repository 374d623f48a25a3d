"""Shared pieces of the end-to-end tests: run ``submit`` as a user would, read results."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from run_checks import trained_and_published

from relax_hpc.checkpoint.store import latest_checkpoint
from relax_hpc.paths import RunPaths, read_json

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def submit_env() -> dict[str, str]:
    """The environment of the runs tests start. They all share one warm-start cache,
    ``$RELAX_HPC_CACHE_DIR`` or the package's default ``~/.cache/relax_hpc``, kept between
    sessions: each warm start (keyed by all that shapes its weights) is trained once, by the
    first run that needs it, under its lock (``tasks/warm_start.cached_training``), and
    published atomically, so runs side by side and parallel sessions share it safely."""
    env = dict(os.environ)
    env.setdefault("RELAX_HPC_CACHE_DIR", str(Path.home() / ".cache" / "relax_hpc"))
    return env


def submit_command(run_dir: Path, *overrides: str, experiment: str = "grpo_tiny") -> list[str]:
    """``python -m relax_hpc.submit +experiment=grpo_tiny cluster=local run_dir=... ...``."""
    return [
        sys.executable,
        "-m",
        "relax_hpc.submit",
        f"+experiment={experiment}",
        "cluster=local",
        f"run_dir={run_dir}",
        *overrides,
    ]


def start_submit(
    run_dir: Path,
    *overrides: str,
    experiment: str = "grpo_tiny",
    env: dict | None = None,
    stdout=subprocess.PIPE,
) -> subprocess.Popen:
    """``submit_command`` started in the background (a local run's submit supervises the
    run until it ends); its stderr, and by default its stdout, piped as text."""
    return subprocess.Popen(
        submit_command(run_dir, *overrides, experiment=experiment),
        cwd=REPO,
        env={**submit_env(), **(env or {})},
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )


def submit(
    run_dir: Path,
    *overrides: str,
    timeout_s: float = 600,
    env: dict | None = None,
    experiment: str = "grpo_tiny",
) -> subprocess.CompletedProcess:
    command = submit_command(run_dir, *overrides, experiment=experiment)
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env={**submit_env(), **(env or {})},
    )


def eval_history(run_dir: Path) -> list[dict]:
    return read_json(RunPaths(run_dir).eval_history)["history"]


def failure_report(result: subprocess.CompletedProcess, run_dir: Path) -> str:
    logs = RunPaths(run_dir).logs_dir
    tails = (
        [
            f"--- {p.name}\n" + "".join(p.read_text(errors="replace").splitlines(True)[-30:])
            for p in sorted(logs.glob("*.log"))
        ]
        if logs.is_dir()
        else []
    )
    return f"exit {result.returncode}\n{result.stderr[-3000:]}\n" + "\n".join(tails)


def scalars(folder: Path) -> dict[str, list[float]]:
    """Every scalar series of one TensorBoard run, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def wait_for_step(status_path, step: int, process, timeout_s: float, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before the trainer was killed"
        try:
            if read_json(status_path)["step"] >= step:
                return
        except (FileNotFoundError, ValueError, KeyError):
            pass
        time.sleep(poll_s)
    raise AssertionError(f"the trainer did not reach step {step} in {timeout_s} s")


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit may wait for an init that never reaps)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def run_task_pids(run_dir) -> list[int]:
    """The processes of a local run's tasks: the trainer, and per rollout task its keeper
    and the worker the keeper runs (launch/keeper.py): 3 for one trainer and one worker."""
    pattern = f"relax_hpc.component (trainer|rollout) --run-dir {run_dir}"
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in found.stdout.split()]


@dataclasses.dataclass(frozen=True)
class KilledThenResumed:
    """A run whose trainer was SIGKILLed, then resumed by a second ``submit``."""

    result: subprocess.CompletedProcess  # the resumed submit
    checkpoint_step: int  # the last complete checkpoint on disk once the trainer was dead


def sigkill_trainer_then_resume(
    run_dir: Path,
    overrides: list[str],
    *,
    experiment: str = "grpo_tiny",
    kill_at_step: int = 4,
    resume_overrides: list[str] | None = None,
) -> KilledThenResumed:
    """Run ``submit``, SIGKILL the trainer once it reached ``kill_at_step`` (no warning, no
    final checkpoint), then ``submit ... resume=auto`` (with ``resume_overrides``, default
    the same overrides). Steps of a tiny run take tens of ms, so the kill lands a step or
    more later than asked: the resume is checked against the checkpoint on disk then, not
    against a step fixed in advance. The run needs enough steps after ``kill_at_step`` that
    it cannot finish first."""
    paths = RunPaths(run_dir)
    first = start_submit(run_dir, *overrides, experiment=experiment)
    wait_for_step(paths.trainer_status, kill_at_step, first, timeout_s=600, poll_s=0.02)
    os.kill(read_json(paths.rendezvous_dir / "trainer.json")["pid"], signal.SIGKILL)
    _, stderr = first.communicate(timeout=300)
    ended = subprocess.CompletedProcess(first.args, first.returncode, "", stderr)
    assert first.returncode != 0 and "trainer[0] exited with -9" in stderr, (
        f"the trainer was not killed (did the run finish first?)\n{failure_report(ended, run_dir)}"
    )
    checkpoint = latest_checkpoint(paths)
    assert checkpoint is not None, (
        f"no checkpoint before the kill\n{failure_report(ended, run_dir)}"
    )
    again = overrides if resume_overrides is None else resume_overrides
    second = submit(run_dir, *again, "resume=auto", experiment=experiment, timeout_s=600)
    return KilledThenResumed(second, checkpoint.step)


def submit_side_by_side(
    runs: dict[str, tuple[Path, list[str]]],
    *,
    experiment: str,
    timeout_s: float = 900,
    env: dict | None = None,
) -> dict[str, subprocess.CompletedProcess]:
    """Several ``submit``s at once, each ``name: (run_dir, overrides)``: their results by
    name. For runs that share no files: on 2 cores one run's generation overlaps the other's
    trainer step, so a pair takes a little more than one run, not two."""
    processes = {
        name: start_submit(run_dir, *overrides, experiment=experiment, env=env)
        for name, (run_dir, overrides) in runs.items()
    }
    deadline = time.monotonic() + timeout_s
    try:
        results = {}
        for name, process in processes.items():
            stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[name] = subprocess.CompletedProcess(
                process.args, process.returncode, stdout, stderr
            )
        return results
    finally:
        for process in processes.values():
            if process.poll() is None:  # a failed wait: its tasks stop when their supervisor dies
                process.kill()
                process.communicate(timeout=60)


@contextlib.contextmanager
def two_at_a_time(calls: dict[str, Callable[[], T]]) -> Iterator[dict[str, Future[T]]]:
    """Each of ``calls`` (independent runs, in the order the tests ask for them) in a thread,
    at most two at once: their futures by name; on exit, the runs not started are dropped
    and the others waited for. A tiny run alternates its trainer and rollout on one core
    and starts three interpreters, so a second run fills the core the first leaves idle;
    results do not depend on it (each run's bounds hold whatever the machine's speed)."""
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        yield {name: pool.submit(call) for name, call in calls.items()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def runs_of_selected_tests(
    request, tmp_path_factory, runs: dict[Callable, Callable[[Path], T]]
) -> Iterator[Callable[[str], tuple[Path, T]]]:
    """``runs`` (test function -> its run, made in the run directory it is given) of the tests
    of ``request``'s module that this session runs, two at a time (``two_at_a_time``):
    yields ``result_of(test name)`` -> (run_dir, what its run returned), which waits for that
    run only. For runs that share nothing; each test still asserts on its own run."""
    selected = {i.originalname for i in request.session.items if i.module is request.module}
    run_dirs = {
        test.__name__: tmp_path_factory.mktemp(test.__name__.removeprefix("test_")[:30]) / "run"
        for test in runs
        if test.__name__ in selected
    }
    calls = {
        test.__name__: functools.partial(run, run_dirs[test.__name__])
        for test, run in runs.items()
        if test.__name__ in run_dirs
    }
    with two_at_a_time(calls) as futures:
        yield lambda name: (run_dirs[name], futures[name].result())


@contextlib.contextmanager
def runs_of_selected_cases(
    request, tmp_path_factory, run_of: Callable[[str, dict], Callable[[Path], T] | None]
) -> Iterator[Callable[[str], T]]:
    """``runs_of_selected_tests`` per case: each selected test of ``request``'s module, a
    parametrized one once per parameter set, gets the run ``run_of(test name, its params)``
    (called with a folder of its own; None: that test has no run), two at a time. Yields
    ``result_of(request.node.name)`` -> what that case's run returned, waiting for that run
    only. For runs that share nothing and each keep one core busy (a submit that stops at a
    config error, a tiny run): on 2 cores the second one runs on the core the first leaves
    idle."""
    items = [i for i in request.session.items if i.module is request.module]
    calls = {}
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        run = run_of(item.originalname, params)
        if run is not None:
            folder = tmp_path_factory.mktemp(item.originalname.removeprefix("test_")[:30])
            calls[item.name] = functools.partial(run, folder)
    with two_at_a_time(calls) as futures:
        yield lambda name: futures[name].result()


# Events of a rollout that crashed and was restarted, or of an engine the trainer gave up on.
FAULTS = ("component_restarted", "weightsync_peer_dropped")


def check_the_model_trained_in_the_mode(run_dir, result, mode: str, steps: int) -> None:
    """A run of ``steps`` in ``mode`` ended well, with no crashed rollout and no engine given
    up on; the trainer's weights reached the engine, which released its memory iff sync
    (the matrix of ``test_model_sources``)."""
    assert result.returncode == 0, failure_report(result, run_dir)
    paths = RunPaths(run_dir)
    assert read_json(paths.trainer_done)["step"] == steps
    faults = [p.name for p in paths.events_dir.glob("*.json") if any(f in p.name for f in FAULTS)]
    assert not faults, failure_report(result, run_dir)
    rollout = read_json(paths.rollout_status(0))
    assert rollout["policy_version"] >= 1  # the trainer's weights reached the engine
    assert ("time/release_memory_s" in rollout["metrics"]) is (mode == "sync")


def selected_params(request, *argnames: str) -> list:
    """The values of the parameters ``argnames`` (a tuple each where several are named) of the
    tests of ``request``'s module that this session runs, in the order they run: ``-k`` one
    case runs one case's run."""
    values = []
    for item in request.session.items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if item.module is request.module and all(name in params for name in argnames):
            found = tuple(params[name] for name in argnames)
            values.append(found if len(argnames) > 1 else found[0])
    return list(dict.fromkeys(values))


def learns_from_media_not_blank(
    root: Path, experiment: str, steps: int, max_shard_bytes_per_step: int
) -> None:
    """``experiment`` (a tiny media run, mode=sync) twice, side by side: with its media, and
    with ``data.blank_media=true`` (the same prompts and answers, blank media). The run with
    the media goes from its weak warm start to >= 80% held-out greedy accuracy (+30 points)
    in ``steps``; the blank control ends >= 30 points below it; the spool keeps a group's
    media once (a step's shards under ``max_shard_bytes_per_step``) and no row was skipped.

    On-policy runs (mode=sync) do not depend on timing, so running the two at once changes
    their wall time, not their results; they share only the warm start, read from the
    cache (trained once, under its lock, where the cache is cold)."""
    arms = {"media": (root / "media", []), "blank": (root / "blank", ["data.blank_media=true"])}
    started = time.monotonic()
    results = submit_side_by_side(arms, experiment=experiment)
    history = {}
    for arm, (run_dir, _) in arms.items():
        assert results[arm].returncode == 0, failure_report(results[arm], run_dir)
        assert "held-out greedy accuracy" in results[arm].stderr
        history[arm] = eval_history(run_dir)
    seeing, blind = history["media"], history["blank"]
    print(f"{experiment}: media {seeing}; blank {blind}; {time.monotonic() - started:.0f} s")
    base, final = seeing[0], seeing[-1]
    assert (base["policy_version"], final["policy_version"]) == (0, steps)
    assert final["accuracy"] >= max(0.8, base["accuracy"] + 0.3), seeing
    assert blind[-1]["policy_version"] == steps
    assert blind[-1]["accuracy"] <= final["accuracy"] - 0.3, blind

    rollout = scalars(RunPaths(arms["media"][0]).rollout_tensorboard_dir(0))
    shard_bytes = [b for b in rollout["spool/shard_bytes"] if b > 0]
    assert shard_bytes and max(shard_bytes) < max_shard_bytes_per_step, shard_bytes
    assert rollout["data/train_rows_skipped"][-1] == 0


MEDIA_RUN_STEPS = 6  # the steps of ``sigkilled_media_run``: killed at 4, checkpoints every 3


def sigkilled_media_run(run_dir: Path, small: list[str], experiment: str) -> KilledThenResumed:
    """A media run whose trainer is SIGKILLed at step 4 of 6 (checkpoints every 3 steps),
    then resumed, for ``check_sigkilled_media_run``."""
    overrides = [
        *small,
        f"trainer.total_steps={MEDIA_RUN_STEPS}",
        "trainer.checkpoint_interval_steps=3",
        "cluster.max_restarts=0",
    ]
    return sigkill_trainer_then_resume(run_dir, overrides, experiment=experiment)


def check_resumed_and_trained_once(run_dir: Path, run: KilledThenResumed, total_steps: int):
    """A run of ``sigkill_trainer_then_resume`` resumed from the checkpoint that was the last
    complete one when its trainer died, trained to ``total_steps``, and every sample of the
    consumed shards was trained once: (trained ids per step, published samples)."""
    from relax_hpc.spool import check_exactly_once

    paths = RunPaths(run_dir)
    assert run.result.returncode == 0, failure_report(run.result, run_dir)
    log = paths.task_log("trainer", 0).read_text()
    assert re.findall(r"resumed from \S+ \(step (\d+)\)", log) == [str(run.checkpoint_step)]
    assert f"step {total_steps}/{total_steps}" in log
    trained, samples = trained_and_published(paths)
    assert len(trained) == total_steps
    published = {s.sample_id for s in samples}
    assert not check_exactly_once(published | {s for step in trained for s in step}, trained)
    return trained, samples


def check_sigkilled_media_run(run_dir: Path, run: KilledThenResumed, media: str):
    """The run of ``sigkilled_media_run`` (``media``: ``images`` or ``audio``) resumed from
    its last checkpoint, and every sample of the consumed shards is trained once, each with
    its ``media``."""
    trained, samples = check_resumed_and_trained_once(run_dir, run, MEDIA_RUN_STEPS)
    published = {s.sample_id for s in samples}
    trained_ids = {s for step in trained for s in step}
    with_media = {s.sample_id for s in samples if s.media is not None and getattr(s.media, media)}
    assert trained_ids <= published and trained_ids <= with_media
