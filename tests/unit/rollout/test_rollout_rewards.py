"""The reward registry, the module:function extension point, and fault-tolerant scoring."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from rollout_reward_fixtures import raising_reward

from relax_hpc.data.datasets import PromptRecord
from relax_hpc.rollout.rewards import (
    RewardResult,
    RewardScorer,
    build_reward,
    call_reward,
    exact_match,
    final_answer,
    format_reward,
    math_reward,
    resolve_reward,
)
from relax_hpc.rollout.rewards.scorer import CLOSE_TIMEOUT_S


def test_exact_match_ignores_surrounding_whitespace_only():
    assert exact_match(" 58\n", "58", {}).score == 1.0
    assert exact_match("5 8", "58", {}).score == 0.0


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("first \\boxed{3}, on reflection \\boxed{4}", "4", 1.0),
        ("first \\boxed{3}, on reflection \\boxed{4}", "3", 0.0),
        ("The area is \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("Thinking...\nAnswer: 42", "42", 1.0),
        ("I do not know.", "42", 0.0),
    ],
)
def test_math_reward_verifies_the_final_answer(completion, answer, score):
    assert math_reward(completion, answer, {}).score == score


def test_final_answer_extraction():
    assert final_answer("x \\boxed{\\{1, 2\\}} y") == "\\{1, 2\\}"
    assert final_answer("\\boxed{a{b}c}") == "a{b}c"
    assert final_answer("Answer: 7\nmore text") == "7"
    assert final_answer("no answer here") is None
    assert math_reward("no answer here", "1", {}).details == {"extracted": None}


def test_format_reward():
    assert format_reward("<think>hm</think> \\boxed{1}", "", {}).score == 1.0
    assert format_reward("<think>hm \\boxed{1}", "", {}).score == 0.0
    assert format_reward("just text", "", {}).details == {"has_answer": False, "think_closed": True}


def test_user_reward_from_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(completion, answer, metadata):\n"
        "    return metadata['weight'] * len(completion)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = RewardScorer("my_rewards:length_bonus", timeout_s=None)
    assert scorer.score([("abc", "", {"weight": 2.0})]) == [RewardResult(6.0)]
    record = PromptRecord("p", [1], "", {"weight": 0.5})
    assert build_reward("my_rewards:length_bonus", timeout_s=None)("abcd", record).score == 2.0


def test_unknown_rewards_are_config_errors():
    with pytest.raises(ValueError, match="rollout.reward: 'exact'"):
        resolve_reward("exact")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="no function"):
        resolve_reward("math:no_such_function")


def test_raising_or_non_numeric_reward_is_recorded_as_failed():
    result = call_reward(raising_reward, "x", "y", {})
    assert result.score == 0.0
    assert result.failed.startswith("raised RuntimeError: judge unavailable at ")
    assert "non-finite" in call_reward(lambda c, a, m: "oops", "x", "y", {}).failed


def test_a_builtin_reward_that_cannot_hang_scores_without_a_child():
    """exact_match (IN_PROCESS_REWARDS) scores in this process even with a timeout: no
    forkserver, no pool worker; a user's reward with the same timeout gets its child."""
    record = PromptRecord("2+2=", [1], "4")
    before = set(descendants(os.getpid()))  # an earlier test's forkserver lives on
    with RewardScorer("exact_match", timeout_s=5.0) as scorer:
        assert scorer(" 4 ", record).score == 1.0 and scorer("5", record).score == 0.0
        assert scorer._pool is None and set(descendants(os.getpid())) <= before
    with RewardScorer("rollout_reward_fixtures:user_exact_match", timeout_s=5.0) as scorer:
        assert scorer(" 4 ", record).score == 1.0
        assert scorer._pool is not None and set(descendants(os.getpid())) - before


def test_timed_out_reward_is_killed_and_the_batch_goes_on():
    with RewardScorer("rollout_reward_fixtures:hanging_reward", timeout_s=1.0) as scorer:
        started = time.monotonic()
        results = scorer.score([("ab", "", {}), ("hang", "", {}), ("abcd", "", {})])
        assert time.monotonic() - started < 30
        assert [r.score for r in results] == [2.0, 0.0, 4.0]
        assert "timed out after 1.0 s" in results[1].failed
        assert results[0].failed is None and results[2].failed is None
    with RewardScorer("rollout_reward_fixtures:raising_reward", timeout_s=5.0) as scorer:
        assert "raised RuntimeError" in scorer.score([("a", "", {})])[0].failed


def test_close_returns_when_the_pool_worker_was_killed_holding_the_queue_lock():
    """A stop signal to the task's process group kills the idle pool worker inside its
    queue read; Pool.terminate() alone then waits on the lock it held forever."""
    scorer = RewardScorer("rollout_reward_fixtures:hanging_reward", timeout_s=5.0)
    assert scorer.score([("ab", "", {})])[0].score == 2.0
    workers = list(scorer._pool._pool)
    os.kill(workers[0].pid, signal.SIGTERM)
    time.sleep(1.0)
    started = time.monotonic()
    closer = threading.Thread(target=scorer.close, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close() hung on the dead worker's queue lock"
    assert time.monotonic() - started < 3 * CLOSE_TIMEOUT_S


SURVIVES_USR1 = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from test_rollout_rewards import alive, descendants
from relax_hpc.data.datasets import PromptRecord
from relax_hpc.rollout.rewards import build_reward

received = []
signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
with build_reward("rollout_reward_fixtures:user_exact_match", timeout_s=5) as scorer:
    assert scorer("4", PromptRecord("2+2=", [1], "4")).score == 1.0
    children = descendants(os.getpid())
    assert len(children) >= 2, children  # the forkserver and the pool's worker
    for pid in [*children, os.getpid()]:
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 20  # a loaded machine may schedule the handler late
    while not received and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the children's turn to die of it, if they would
    assert all(alive(pid) for pid in children), "a reward process died of USR1"
    assert scorer("5", PromptRecord("2+2=", [1], "4")).score == 0.0
assert received == [1], received  # this process's own handler was restored, not ignored
print("survived")
"""


def test_reward_processes_outlive_the_stop_signal_of_the_step():
    """Slurm sends a step's USR1 to every process of the task: the reward server and its
    worker must survive it (the rollout finishes its batch, then closes the pool). Run in
    a child process: without the fix the rollout hangs on a dead pool."""
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).parent)
    # The child imports torch and starts a forkserver and a pool: 60 s ran out at load 11.
    result = subprocess.run(
        [sys.executable, "-c", SURVIVES_USR1, here], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0 and "survived" in result.stdout, result.stderr[-2000:]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc (Linux)."""
    from pathlib import Path

    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def alive(pid: int) -> bool:
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
