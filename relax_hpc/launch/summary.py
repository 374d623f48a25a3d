"""The closing summary a user reads after a local run: what was learned, where things are."""

from __future__ import annotations

import sys

from relax_hpc.launch.outcome import StartEnd
from relax_hpc.paths import RunPaths, read_json


def summary_lines(paths: RunPaths, end: StartEnd) -> list[str]:
    lines = []
    done = read_json(paths.trainer_done, default=None)
    trainer = read_json(paths.trainer_status, default=None)
    evals = read_json(paths.eval_history, default={}).get("history", [])
    if done:
        lines.append(f"finished {done['step']} steps ({done['samples']} samples)")
    elif trainer:
        lines.append(
            f"{end.outcome} at step {trainer['step']} ({end.detail}); "
            f"resume with run_dir={paths.root}"
        )
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"held-out greedy accuracy {first['accuracy']:.1%} (policy v{first['policy_version']}) "
            f"-> {last['accuracy']:.1%} (v{last['policy_version']})"
        )
    lines.append(f"TensorBoard: tensorboard --logdir {paths.tensorboard_dir}")
    if done:
        lines.append(f"exported Hugging Face model: {done['export_dir']}")
    lines.append(f"logs: {paths.logs_dir}")
    return lines


def print_summary(paths: RunPaths, end: StartEnd) -> None:
    for line in summary_lines(paths, end):
        print(f"relax_hpc: {line}", file=sys.stderr)


def failed_rewards(metrics: dict) -> str:
    """Samples trained with no weight because their reward failed, when there are any."""
    failed = metrics.get("rewards/failed_samples_total", 0.0)
    if not failed:
        return ""
    dropped = metrics.get("rewards/dropped_groups_total", 0.0)
    return f" | reward failed {failed:.0f} (groups dropped {dropped:.0f})"


class ProgressReporter:
    """A console progress line with ETA, from the trainer's status file.

    On a terminal the line is rewritten in place every ``interval_s``; in a log file one
    line is written every ``log_interval_s``.
    """

    def __init__(self, paths: RunPaths, total_steps: int, stream=sys.stderr, clock=None) -> None:
        import time

        self.paths = paths
        self.total_steps = total_steps
        self.stream = stream
        self.clock = clock or time.monotonic
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.interval_s = 1.0 if self.tty else 30.0
        self.last_print = -float("inf")
        self.last_text: str | None = None
        self.first: tuple[float, int] | None = None

    def line(self) -> str | None:
        status = read_json(self.paths.trainer_status, default=None)
        if not status:
            return self.warm_start_line()
        step, now = int(status["step"]), self.clock()
        if self.first is None or step < self.first[1]:
            self.first = (now, step)
        rate = (step - self.first[1]) / (now - self.first[0]) if now > self.first[0] else 0.0
        eta = f"{(self.total_steps - step) / rate:.0f} s" if rate > 0 else "?"
        metrics = status.get("metrics", {})
        evals = read_json(self.paths.eval_history, default={}).get("history", [])
        accuracy = f" | eval {evals[-1]['accuracy']:.1%}" if evals else ""
        return (
            f"[{_bar(step, self.total_steps)}] step {step}/{self.total_steps} | reward {metrics.get('reward/mean', 0.0):.3f}"
            f"{accuracy}{failed_rewards(metrics)}{self.episodes()} | {rate:.2f} steps/s | ETA {eta}"
        )

    def warm_start_line(self) -> str | None:
        """Before step 1: the supervised warm start's progress (``WarmStartStatus``)."""
        status = read_json(self.paths.warm_start_status, default=None)
        if not isinstance(status, dict) or not status.get("total_steps"):
            return None
        step, total, elapsed = status["step"], status["total_steps"], status["elapsed_s"]
        eta = f"{(total - step) * elapsed / step:.0f} s" if step and elapsed else "?"
        loss = f"{status['loss']:.3f}" if status.get("loss") is not None else "?"
        return (
            f"[{_bar(step, total)}] {status['phase']}: step {step}/{total} | loss {loss} "
            f"| ETA {eta} (then RL, {self.total_steps} steps)"
        )

    def episodes(self) -> str:
        """Multi-turn runs: rollout worker 0's last batch of episodes (docs/agents.md)."""
        rollout = read_json(self.paths.rollout_status(0), default={}).get("metrics", {})
        if "agent/turns_mean" not in rollout:
            return ""
        return (
            f" | turns {rollout['agent/turns_mean']:.1f}, tools "
            f"{rollout['agent/tool_calls_mean']:.2f}/ep (failed {rollout['agent/tool_error_rate']:.0%},"
            f" timeouts {rollout['agent/tool_timeouts']:.0f}), len "
            f"{rollout['agent/response_tokens_mean']:.0f} (obs "
            f"{rollout['agent/observation_token_share']:.0%})"
        )

    def tick(self) -> None:
        if self.clock() - self.last_print < self.interval_s:
            return
        text = self.line()
        if text is None:  # no status yet: the interval starts at the first line written
            return
        self.last_print = self.clock()
        self.write(text)

    def write(self, text: str) -> None:
        self.last_text = text
        self.stream.write(f"\r{text}" if self.tty else f"relax_hpc: {text}\n")
        self.stream.flush()

    def close(self) -> None:
        """A log file ends with the last progress line too: a run shorter than the
        interval would otherwise show none."""
        if not self.tty:
            text = self.line()
            if text is not None and text != self.last_text:
                self.write(text)
        elif self.first is not None:
            self.stream.write("\n")


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * done / max(total, 1))
    return "#" * filled + "." * (width - filled)
