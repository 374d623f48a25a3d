"""grpo_tiny end to end: time to the target accuracy, throughput, and the async speed-up.

Runs ``python -m relax_hpc.submit +experiment=grpo_tiny cluster=local`` twice with the same
number of steps, once ``mode=async`` (max_staleness 1) and once ``mode=sync``, and prints,
measured in this one run:

- time from the first training step to the first held-out eval >= --target (async run);
- samples/s and generated tokens/s of each mode;
- the async speed-up = wall time of sync / wall time of async, next to the ideal speed-up
  (generation time + training time) / max(generation time, training time) of the sync run,
  i.e. what perfect overlap of the two roles would give.

The warm start is cached (first run ~2 min extra). Usage:
    python benchmarks/e2e_tiny.py [--steps 60] [--target 0.9]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]


def events(folder: Path) -> dict[str, list]:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}


def submit_command(mode: str, steps: int, root: Path, overrides: Sequence[str] = ()) -> list[str]:
    """The ``relax_hpc.submit`` command of grpo_tiny in ``mode`` for ``steps`` steps under
    ``root/mode`` (plus Hydra ``overrides``)."""
    staleness = "1" if mode == "async" else "0"
    # async: the trainer sends each version while it trains on (trainer/publish.py)
    background = "true" if mode == "async" else "false"
    return [
        sys.executable,
        "-m",
        "relax_hpc.submit",
        "+experiment=grpo_tiny",
        "cluster=local",
        f"run_dir={root / mode}",
        f"mode={mode}",
        f"max_staleness={staleness}",
        f"weightsync.background_send={background}",
        f"trainer.total_steps={steps}",
        "trainer.checkpoint_interval_steps=1000",
        *overrides,
    ]


def run(mode: str, steps: int, root: Path, overrides: Sequence[str] = ()) -> Path:
    """grpo_tiny in ``mode`` for ``steps`` steps under ``root/mode`` (plus Hydra ``overrides``)."""
    subprocess.run(
        submit_command(mode, steps, root, overrides),
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return root / mode


def measure(run_dir: Path, target: float) -> dict[str, float]:
    trainer = events(run_dir / "tensorboard" / "trainer")
    rollout = events(run_dir / "tensorboard" / "rollout-0")
    steps = trainer["reward/mean"]
    start, end = steps[0].wall_time, steps[-1].wall_time
    samples = trainer["progress/samples"][-1].value - trainer["progress/samples"][0].value
    tokens = sum(e.value for e in rollout["throughput/tokens_per_s"]) / max(
        len(rollout["throughput/tokens_per_s"]), 1
    )
    intervals = max(len(steps) - 1, 1)
    generate_s = sum(e.value for e in rollout["time/generate_s"])
    train_s = sum(e.value for e in trainer["time/train_s"]) + sum(
        e.value for e in trainer["time/prepare_s"]
    )
    reached = [e for e in rollout.get("eval/accuracy", []) if e.value >= target]
    return {
        "start_time": start,  # wall clock (time.time()) at the end of step 1
        "end_time": end,
        "samples": samples,
        "wall_s": end - start,
        "step_s": (end - start) / intervals,
        "generate_step_s": generate_s / max(len(rollout["time/generate_s"]), 1),
        "train_step_s": train_s / max(len(trainer["time/train_s"]), 1),
        "samples_per_s": samples / (end - start),
        "tokens_per_s": tokens,
        "generate_s": generate_s,
        "train_s": train_s,
        "time_to_target_s": (reached[0].wall_time - start) if reached else float("nan"),
        "final_accuracy": rollout["eval/accuracy"][-1].value
        if "eval/accuracy" in rollout
        else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--target", type=float, default=0.9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            mode: measure(run(mode, args.steps, Path(tmp)), args.target)
            for mode in ("async", "sync")
        }
    a, s = results["async"], results["sync"]
    for mode, r in results.items():
        print(
            f"{mode:5s}: {args.steps} steps in {r['wall_s']:.1f} s | {r['samples_per_s']:.0f} samples/s | "
            f"{r['tokens_per_s']:.0f} generated tokens/s | final held-out accuracy {r['final_accuracy']:.1%} | "
            f"time to {args.target:.0%}: {r['time_to_target_s']:.1f} s"
        )
    ideal = (s["generate_s"] + s["train_s"]) / max(s["generate_s"], s["train_s"])
    print(
        f"async speed-up (sync wall / async wall): {s['wall_s'] / a['wall_s']:.2f} "
        f"| ideal (generate + train) / max(generate, train) of the sync run: {ideal:.2f} "
        f"(generate {s['generate_s']:.1f} s, train {s['train_s']:.1f} s)"
    )

    print_overlap(a, s)


def print_overlap(a: dict[str, float], s: dict[str, float]) -> None:
    """Step time against what each mode can at best do with its own phases: async overlaps
    generation with training (bound: the longer of the two), sync runs them in turn."""
    bound_async = max(a["generate_step_s"], a["train_step_s"])
    bound_sync = s["generate_step_s"] + s["train_step_s"]
    print(
        f"async step {a['step_s']:.3f} s / max(generate {a['generate_step_s']:.3f}, "
        f"train {a['train_step_s']:.3f}) = {a['step_s'] / bound_async:.2f} (goal <= 1.15); "
        f"sync step {s['step_s']:.3f} s / (generate + train {bound_sync:.3f}) = "
        f"{s['step_s'] / bound_sync:.2f} (goal <= 1.10)"
    )


if __name__ == "__main__":
    main()
