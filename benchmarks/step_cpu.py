"""One grpo_tiny run's CPU per step, from its own timers: cheap enough to run before and
after a change, back to back, several times (no py-spy, no TRL).

Runs ``e2e_tiny.run`` (held-out eval only before step 1 and after the last) and prints,
over steps 2..N: each role's whole-process CPU per step (``cpu/process_s``, every thread),
the CPU per sample of both, the part of each process's CPU outside its work (trainer:
process minus ``train`` and ``prepare``; rollout: process minus ``generate``), and every
phase timer's mean wall (``time/*``) and loop-thread CPU (``cpu/*``) in ms per step, with
the machine's 1-minute load average before and after. ``profile_grpo_tiny.py`` says what
is inside the phases. Usage:
    python benchmarks/step_cpu.py [--mode sync] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
import e2e_tiny  # noqa: E402


def means_ms(run_dir: Path, role: str) -> tuple[dict[str, float], float]:
    """Mean ms per step of every ``time/*`` and ``cpu/*`` scalar of ``role`` over steps >= 2,
    and (trainer only) the samples per step."""
    events = e2e_tiny.events(run_dir / "tensorboard" / role)
    means = {}
    for tag, series in events.items():
        values = [e.value for e in series if e.step >= 2]
        if tag.startswith(("cpu/", "time/")) and values:
            means[tag] = sum(values) / len(values) * 1e3
    samples = events.get("progress/samples", [])
    per_step = (samples[-1].value - samples[0].value) / max(len(samples) - 1, 1) if samples else 0
    return means, per_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="sync", choices=("async", "sync"))
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="step-cpu-"))
    run_dir = e2e_tiny.run(
        args.mode, args.steps, root, [f"rollout.eval_interval_steps={args.steps}"]
    )
    trainer, samples = means_ms(run_dir, "trainer")
    rollout, _ = means_ms(run_dir, "rollout-0")
    trainer_s, rollout_s = trainer["cpu/process_s"], rollout["cpu/process_s"]
    outside = (
        trainer_s - trainer.get("cpu/train_s", 0) - trainer.get("cpu/prepare_s", 0),
        rollout_s - rollout.get("cpu/generate_s", 0),
    )
    print(
        f"{args.mode}, load {load_before:.1f} -> {os.getloadavg()[0]:.1f}: process CPU trainer "
        f"{trainer_s:.1f} + rollout {rollout_s:.1f} ms/step = "
        f"{(trainer_s + rollout_s) / max(samples, 1):.3f} ms/sample; outside the work: "
        f"trainer {outside[0]:.1f}, rollout {outside[1]:.1f} ms/step"
    )
    for role, means in (("trainer", trainer), ("rollout", rollout)):
        for tag in sorted(t for t in means if "process" not in t and "eval" not in t):
            print(f"  {role}:{tag:32s} {means[tag]:8.2f} ms/step")


if __name__ == "__main__":
    main()
