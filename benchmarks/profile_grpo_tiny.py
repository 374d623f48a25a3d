"""Where a grpo_tiny run spends its CPU: per process and per phase, in ms per training step.

Runs ``python -m relax_hpc.submit +experiment=grpo_tiny cluster=local`` (``e2e_tiny``'s
command line, held-out eval only before step 1 and after the last) under two observers:

- ``TreeCpuSampler`` (``process_cpu.py``): the exact CPU seconds of every process of the
  run (supervisor, trainer, keeper, rollout, the reward child and its forkserver, ...),
  from /proc, over the whole run and over the timed steps (end of step 1 to the end);
- ``py-spy record --subprocesses --nonblocking`` at ``--rate`` Hz: which Python frames
  each process was in. py-spy counts a thread that waits for a core as busy, so on a
  loaded machine its sample counts overstate CPU; only its *shares* are used: a main
  thread's CPU seconds over the whole run are split by the share of its samples in each
  phase. A helper thread is named by its Python target and gets its own /proc CPU.

Each role's own timers give the exact CPU of its loop's phases (``cpu/<phase>_s`` of
``PhaseTimer``: the thread's CPU inside each phase) and of its whole process per step
(``cpu/process_s``); py-spy shows what is inside them. A py-spy phase is named by the
innermost frame that matches ``RULES`` (e.g. ``Trainer.publish`` -> weight sync;
``SampleScorer`` inside ``RolloutWorker.generate`` -> scoring); samples outside the main loops (imports, model build, evals, shutdown) are "startup/shutdown" and not
divided by steps. Needs py-spy (``pip install py-spy``; not a dependency). Usage:
    python benchmarks/profile_grpo_tiny.py [--mode async] [--steps 100] [--rate 200]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
import e2e_tiny  # noqa: E402
from process_cpu import TreeCpuSampler  # noqa: E402

# (frame substring, phase): the innermost matching frame of a stack names its phase.
RULES = (
    # the trainer loop
    ("Trainer.run ", "trainer: loop (other)"),
    ("Trainer.next_batch ", "trainer: claim + read batch"),
    ("collate ", "trainer: collate"),
    ("mask_failed_rewards ", "trainer: collate"),
    ("prepare_step ", "trainer: old log-probs + advantages"),
    ("update_policy ", "trainer: train (forward, backward, step)"),
    ("Trainer.batch_metrics ", "trainer: log"),
    ("mark_step_consumed ", "trainer: spool ledger"),
    ("Trainer.publish ", "trainer: weight sync"),
    ("Trainer.maybe_checkpoint ", "trainer: checkpoint"),
    ("Trainer.log ", "trainer: log"),
    # the rollout loop
    ("RolloutWorker.run ", "rollout: loop (other)"),
    ("RolloutWorker.maybe_load_weights ", "rollout: claim chunk"),
    ("EngineWeights.wait_for ", "rollout: weight receive + load"),
    ("RolloutWorker.generate ", "rollout: generation"),
    ("RolloutWorker._prompt ", "rollout: prompts"),
    ("SampleScorer.", "rollout: scoring"),
    (".decode ", "rollout: detokenize"),
    ("RolloutWorker._sample ", "rollout: build samples"),
    ("RolloutWorker.write_shard ", "rollout: publish shard"),
    ("GroupAssignment.complete ", "rollout: complete chunk"),
    ("RolloutWorker.log ", "rollout: log"),
    ("RolloutWorker.maybe_eval ", "startup/shutdown"),  # evals run before and after the steps
)
STARTUP = "startup/shutdown"


def phase_of(frames: list[str]) -> str:
    """The phase of one main-thread stack (outermost frame first)."""
    phase = STARTUP
    for frame in frames:
        for pattern, name in RULES:
            if pattern in frame:
                phase = name
    return phase


def thread_phase(frames: list[str]) -> str:
    """A helper thread is named by the first frame of its target (after Thread.run)."""
    for i, frame in enumerate(frames):
        if frame.startswith("Thread.run ") and i + 1 < len(frames):
            return "thread: " + frames[i + 1].split(" (")[0]
    return "thread: " + (frames[0].split(" (")[0] if frames else "?")


def parse_raw(path: Path) -> dict[tuple[int, int], collections.Counter]:
    """py-spy's raw output -> (pid, thread id) -> Counter(phase -> samples)."""
    counts: dict[tuple[int, int], collections.Counter] = collections.defaultdict(
        collections.Counter
    )
    for line in path.read_text().splitlines():
        stack, _, number = line.rpartition(" ")
        parts = stack.split(";")
        if not parts[0].startswith("process ") or not number.isdigit():
            continue
        # a child's stacks are nested under its parents: "process A;process B;thread ..."
        last = max(i for i, part in enumerate(parts) if part.startswith("process "))
        pid = int(parts[last].split(":")[0].removeprefix("process "))
        frames = parts[last + 1 :]
        tid = pid
        if frames and frames[0].startswith("thread ("):
            tid = int(frames[0].removeprefix("thread (").split(")")[0], 0)
            frames = frames[1:]
        is_thread = bool(frames) and frames[0].startswith("Thread._bootstrap ")
        phase = thread_phase(frames) if is_thread else phase_of(frames)
        counts[(pid, tid)][phase] += int(number)
    return counts


def split_process(pid: int, whole_s: float, sampler: TreeCpuSampler, counts) -> collections.Counter:
    """CPU seconds of one process over the whole run, by phase: each helper thread's own
    CPU (exact, /proc) under the name of its Python target; the main thread's CPU (the
    rest) split by py-spy's shares of its samples."""
    out: collections.Counter = collections.Counter()
    threads = {tid: s for (p, tid), s in sampler.thread_cpu_s.items() if p == pid}
    for tid, seconds in threads.items():
        if tid != pid:
            names = counts.get((pid, tid))
            out[names.most_common(1)[0][0] if names else "thread: native (no Python)"] += seconds
    main_s = whole_s - sum(out.values())
    main = counts.get((pid, pid), collections.Counter())
    total = sum(main.values())
    for phase, number in main.items():
        out[phase] += main_s * number / total
    if not total:
        out[STARTUP] += main_s
    return out


def run(mode: str, steps: int, rate: int, root: Path):
    command = e2e_tiny.submit_command(mode, steps, root, [f"rollout.eval_interval_steps={steps}"])
    raw = root / f"pyspy-{mode}.txt"
    spy = [
        shutil.which("py-spy") or "py-spy",
        "record",
        "--subprocesses",
        "--nonblocking",
        "--threads",
        "--format",
        "raw",
        "--rate",
        str(rate),
        "--output",
        str(raw),
        "--",
        *command,
    ]
    process = subprocess.Popen(
        spy, cwd=e2e_tiny.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    # py-spy runs the command as its child: sample py-spy's tree, then leave py-spy out
    sampler = TreeCpuSampler(process.pid, "py-spy", interval_s=0.2).start()
    _, stderr = process.communicate()
    sampler.stop()
    if process.returncode != 0 or not raw.exists():
        raise SystemExit(f"py-spy or the run failed ({process.returncode}):\n{stderr[-3000:]}")
    measured = e2e_tiny.measure(root / mode, target=1.0)
    measured["timer_cpu"] = timer_cpu(root / mode, steps)
    return sampler, parse_raw(raw), measured


def timer_cpu(run_dir: Path, steps: int) -> dict[str, dict[str, float]]:
    """role -> ``cpu/*`` timer -> mean CPU seconds per step over steps 2..``steps``: each
    phase's CPU on the loop's thread, and ``cpu/process_s`` (every thread of the process)."""
    out = {}
    for role in ("trainer", "rollout-0"):
        series = e2e_tiny.events(run_dir / "tensorboard" / role)
        out[role] = {
            tag: statistics.fmean(values)
            for tag, points in series.items()
            if tag.startswith("cpu/")
            and (values := [p.value for p in points if 2 <= p.step <= steps])
        }
    return out


def print_timer_cpu(cpu: dict[str, dict[str, float]]) -> None:
    print("by phase, from each role's own timers (CPU of its loop's thread, ms/step):")
    for role, timers in cpu.items():
        process = timers.get("cpu/process_s", 0.0)
        print(f"  {role}: {process * 1000:.2f} ms/step, every thread")
        # the rollout's generate timer encloses its score timer
        nested = {"cpu/generate_s": "cpu/score_s"}
        phases = 0.0
        for tag, seconds in sorted(timers.items(), key=lambda kv: -kv[1]):
            if tag == "cpu/process_s":
                continue
            own = seconds - timers.get(nested.get(tag, ""), 0.0)
            phases += own
            note = " (less scoring)" if tag in nested else ""
            print(f"    {tag.removeprefix('cpu/').removesuffix('_s'):22s} {own * 1000:8.2f}{note}")
        print(f"    {'rest (threads, untimed)':22s} {(process - phases) * 1000:8.2f}")


def report(mode: str, steps: int, sampler: TreeCpuSampler, counts, measured) -> None:
    window = sampler.cpu_between(measured["start_time"], measured["end_time"])
    timed_steps = steps - 1
    print(
        f"grpo_tiny {mode}, {steps} steps: {measured['step_s'] * 1000:.1f} ms/step wall, "
        f"{sum(v for k, v in window.items() if k != 'py-spy') / timed_steps * 1000:.1f} CPU "
        f"ms/step, all processes (timed steps 2..{steps}, exact, /proc)"
    )
    print(f"{'process':34s} {'CPU ms/step (timed)':>20s} {'CPU s (whole run)':>18s}")
    for label, seconds in sorted(window.items(), key=lambda kv: -kv[1]):
        if label == "py-spy":
            continue
        whole = sum(s.at(float("inf")) for s in sampler.series.values() if s.label == label)
        print(f"{label:34s} {seconds / timed_steps * 1000:20.2f} {whole:18.2f}")
    print_timer_cpu(measured["timer_cpu"])
    print(
        "by phase, py-spy's view (whole run; loop phases also per step; py-spy counts a thread "
        "waiting for a core, or in fsync, as busy):"
    )
    for pid, series in sorted(sampler.series.items()):
        whole = series.at(float("inf"))
        if series.label == "py-spy" or whole < 0.01:
            continue
        print(f"  {series.label} (pid {pid}, {whole:.2f} CPU s)")
        for phase, seconds in split_process(pid, whole, sampler, counts).most_common():
            if seconds < 0.01:
                continue
            per = "" if phase == STARTUP else f"{seconds / steps * 1000:8.2f} ms/step"
            print(f"    {phase:44s} {seconds:7.2f} s {per}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="async", choices=("async", "sync"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    with tempfile.TemporaryDirectory(prefix="profile_grpo_tiny.") as tmp:
        sampler, counts, measured = run(args.mode, args.steps, args.rate, Path(tmp))
    report(args.mode, args.steps, sampler, counts, measured)


if __name__ == "__main__":
    main()
