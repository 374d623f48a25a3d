"""grpo_tiny side by side: Hugging Face TRL's GRPOTrainer against relax_hpc, async and sync.

Both frameworks train grpo_tiny's own task (2-digit addition, ``configs/experiment/
grpo_tiny.yaml``) from the same cached warm start, on the same prompts in the same order,
16 prompts x 8 samples per optimizer step, scored by relax_hpc's own reward (exact match),
with the same optimizer and loss. Printed, measured in this one run:

- samples/s and s/step of each (the first step is not timed: from the end of step 1 to the
  end of step N, as ``benchmarks/e2e_tiny.py`` measures relax_hpc);
- CPU seconds per sample of each over the same window, all processes counted (TRL's
  process and its reward child; relax_hpc's supervisor, trainer, rollout keeper and worker,
  reward child, ...), read from /proc by ``process_cpu.TreeCpuSampler``, per process too;
- relax_hpc's overlap: its step time over max(generation, training) of its own timers
  (1.0: the two roles fully overlap; sync mode is bounded by their sum instead);
- cores each process kept busy (its CPU s over the window's wall s): in async mode,
  whether the trainer and the rollout each keep one core busy;
- final held-out greedy accuracy of each, by relax_hpc's own evaluator (``rollout.evaluation.
  make_evaluator``: 256 held-out pairs, greedy, exact match);
- relax_hpc / TRL for each relax_hpc mode: samples/s, s/step and CPU s/sample, next to the
  targets of issue 33; ``--json PATH`` writes every figure (``build_report``);
- relax_hpc's step phase by phase, read from its own timers (TensorBoard ``time/*`` under
  ``RUN_DIR/tensorboard/{trainer,rollout-0}``); a phase without a timer prints
  ``n/a (no timer)``.

How each side is built:

- TRL runs in this process (``trl`` is the ``bench`` extra: ``pip install -c
  constraints/ci.txt -e '.[bench]'``). Its model and tokenizer come from relax_hpc's
  ``trainer.networks.initial_model_config`` (the warm-start folder, trained once and
  cached) and ``models.build``: the same weights the relax_hpc trainer starts from. Its
  dataset is relax_hpc's prompt stream (``PromptSampler`` with the run's seed) in draw
  order, with ``shuffle_dataset=False``: step k sees the prompts relax_hpc's step k sees.
- relax_hpc runs as ``python -m relax_hpc.submit +experiment=grpo_tiny cluster=local``
  (``e2e_tiny.run``), two processes of one thread each. Its periodic held-out eval is moved
  out of the timed loop (``rollout.eval_interval_steps`` = ``--steps``: it evaluates policy
  0 and the final policy only), because TRL evaluates nothing while it trains.

What this leaves out: TRL's own profiling (only its wall time per step is taken), vLLM,
more than one process for TRL. Usage:
    python benchmarks/trl_side_by_side.py [--steps 200] [--modes async,sync]
        [--skip-trl] [--skip-relax] [--trl-threads 2] [--json report.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
import e2e_tiny  # noqa: E402
from process_cpu import TreeCpuSampler  # noqa: E402

from relax_hpc.config import RunConfig  # noqa: E402
from relax_hpc.config.compose import compose_run_config  # noqa: E402
from relax_hpc.data.datasets import PromptRecord, build_dataset  # noqa: E402
from relax_hpc.data.sampler import PromptSampler  # noqa: E402
from relax_hpc.models.build import build_causal_lm, build_tokenizer  # noqa: E402
from relax_hpc.observe.metrics import MetricsLogger  # noqa: E402
from relax_hpc.paths import RunPaths  # noqa: E402
from relax_hpc.rollout.engines.base import Completion  # noqa: E402
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine  # noqa: E402
from relax_hpc.rollout.evaluation import make_evaluator  # noqa: E402
from relax_hpc.rollout.scoring import SampleScorer, make_scorer  # noqa: E402
from relax_hpc.trainer.networks import initial_model_config  # noqa: E402

EXPERIMENT = ["+experiment=grpo_tiny", "cluster=local"]
# The targets: relax_hpc samples/s over TRL's, per mode; CPU s/sample over TRL's;
# async step over max(generation, training).
TARGETS = {"async": 1.5, "sync": 1.0}
TARGET_CPU_RATIO = 1.1
TARGET_OVERLAP = 1.15
# What TRL cannot express the way relax_hpc's grpo_tiny does (printed in the header).
MISMATCHES = (
    "advantage (s - mean) / (std + eps): relax eps 1e-6, TRL eps 1e-4 (hard-coded in TRL)",
    "sampling: relax draws one seeded float64 uniform per token per sample (inverse CDF); "
    "TRL samples with HF generate's multinomial; same distribution, other random draws",
    "relax async generates with a policy up to 1 version old (max_staleness 1), uncorrected "
    "(tis_mode none); TRL is always on-policy (as relax sync)",
    "cores: relax runs 2 processes x 1 torch thread; TRL 1 process x --trl-threads (default 2)",
)
# Matched exactly, for the record: dual-clip c=3 is TRL's delta=3 (the same loss whenever
# c > 1 + clip_high); token-mean is TRL's loss_type "dapo" (one accumulation step).


@dataclass
class Result:
    """One framework's timed loop, its CPU and its final held-out accuracy."""

    name: str
    steps_timed: int  # optimizer steps inside the timed window
    wall_s: float
    samples: float  # trained inside the timed window
    final_accuracy: float
    start_accuracy: float  # of the policy it started from: equal when the weights are
    cpu_s: dict[str, float]  # CPU seconds inside the timed window, per process (role)
    generate_step_s: float | None = None  # relax_hpc: mean of its generate timer
    train_step_s: float | None = None  # relax_hpc: mean of its prepare + train timers

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s

    @property
    def s_per_step(self) -> float:
        return self.wall_s / max(self.steps_timed, 1)

    @property
    def cpu_s_per_sample(self) -> float:
        return sum(self.cpu_s.values()) / self.samples

    @property
    def overlap(self) -> float | None:
        """Step time over max(generation, training): 1.0 is perfect overlap (async)."""
        if self.generate_step_s is None or self.train_step_s is None:
            return None
        return self.s_per_step / max(self.generate_step_s, self.train_step_s)

    @property
    def cores_busy(self) -> dict[str, float]:
        """Cores each process kept busy over the timed window (its CPU s / wall s): in async
        mode, whether the trainer and the rollout each keep one core busy."""
        return {name: seconds / self.wall_s for name, seconds in self.cpu_s.items()}

    def report(self, baseline: Result | None) -> dict:
        """Every figure of this result, with the ratios to ``baseline`` (TRL)."""
        out = {
            "samples_per_s": self.samples_per_s,
            "s_per_step": self.s_per_step,
            "cpu_s_per_sample": self.cpu_s_per_sample,
            "cpu_s_by_process": self.cpu_s,
            "final_accuracy": self.final_accuracy,
            "start_accuracy": self.start_accuracy,
            "steps_timed": self.steps_timed,
            "samples_timed": self.samples,
            "generate_step_s": self.generate_step_s,
            "train_step_s": self.train_step_s,
            "overlap": self.overlap,
            "cores_busy_by_process": self.cores_busy,
        }
        if baseline is not None:
            out["ratio_samples_per_s"] = self.samples_per_s / baseline.samples_per_s
            out["ratio_s_per_step"] = self.s_per_step / baseline.s_per_step
            out["ratio_cpu_s_per_sample"] = self.cpu_s_per_sample / baseline.cpu_s_per_sample
        return out


# --- the shared starting point ----------------------------------------------------------------
def grpo_tiny_config(steps: int) -> RunConfig:
    """grpo_tiny as relax_hpc composes it (``steps`` training steps)."""
    return compose_run_config([*EXPERIMENT, f"trainer.total_steps={steps}"])


def warm_started_policy(cfg: RunConfig):
    """The model and tokenizer relax_hpc's trainer starts from (``trainer/networks.py``)."""
    model_cfg = initial_model_config(cfg)
    tokenizer = build_tokenizer(model_cfg)
    return build_causal_lm(model_cfg, tokenizer, torch.float32, seed=cfg.seed), tokenizer


def prompt_stream(cfg: RunConfig, tokenizer, num_prompts: int) -> list[tuple[int, PromptRecord]]:
    """The first ``num_prompts`` (data_index, record) draws of the rollout's prompt stream:
    group g of relax_hpc is draw g (``RolloutWorker._prompt``)."""
    dataset = build_dataset(cfg.data, tokenizer, split="train")
    sampler = PromptSampler(dataset, seed=cfg.seed, shuffle=cfg.data.shuffle)
    return sampler.take(num_prompts)


def relax_reward(score: SampleScorer, records: dict[int, PromptRecord]) -> Callable[..., list]:
    """A TRL reward function that scores with relax_hpc's own scorer (``rollout.reward``)."""

    def exact_match(prompts, completions, completion_ids, data_index, **_) -> list[float]:
        pairs = [
            (as_completion(f"trl/{i}", text, ids), records[index])
            for i, (text, ids, index) in enumerate(
                zip(completions, completion_ids, data_index, strict=True)
            )
        ]
        return [value for value, _ in score(pairs)]

    return exact_match


def as_completion(sample_id: str, text: str, token_ids: Sequence[int]) -> Completion:
    """What relax_hpc's scorer reads of a completion (its text) around TRL's output."""
    return Completion(
        sample_id=sample_id,
        prompt_ids=[],
        token_ids=list(token_ids),
        logprobs=[],
        finish_reason="stop",
        text=text,
        policy_version=0,
    )


def held_out_accuracy(cfg: RunConfig, model, tokenizer, run_dir: Path) -> float:
    """relax_hpc's greedy held-out eval (``make_evaluator``) of ``model``."""
    paths = RunPaths(run_dir).create()
    engine = TransformersEngine(model, tokenizer)
    score = make_scorer(cfg, paths, torch.device("cpu"))
    evaluate = make_evaluator(cfg, engine, tokenizer, score, MetricsLogger(None, None), paths)
    try:
        return evaluate(policy_version=0)["eval/accuracy"]
    finally:
        score.close()


# --- TRL ---------------------------------------------------------------------------------------
def trl_config(cfg: RunConfig, steps: int, output_dir: Path):
    """GRPOConfig with grpo_tiny's batch and hyperparameters (mismatches: ``MISMATCHES``)."""
    from trl import GRPOConfig

    algo, trainer, rollout = cfg.algo.with_algorithm_defaults(), cfg.trainer, cfg.rollout
    if algo.policy_loss != "ppo_clip" or algo.loss_agg_mode != "token-mean":
        raise ValueError(f"only GRPO with ppo_clip/token-mean is mapped to TRL, got {algo}")
    completions_per_step = rollout.prompts_per_step * rollout.n_samples_per_prompt
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        seed=cfg.seed,
        # one optimizer step consumes one generation batch of 16 prompts x 8 samples
        per_device_train_batch_size=completions_per_step,
        gradient_accumulation_steps=1,
        generation_batch_size=completions_per_step,
        num_generations=rollout.n_samples_per_prompt,
        num_iterations=trainer.epochs_per_step,
        shuffle_dataset=False,  # the dataset is already relax_hpc's prompt stream
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=0 if rollout.top_k == -1 else rollout.top_k,
        max_completion_length=rollout.max_new_tokens,
        mask_truncated_completions=False,
        # loss: GRPO advantages, PPO clip, dual-clip as delta, token mean, no KL or entropy
        scale_rewards="group",
        loss_type="dapo",
        epsilon=algo.clip_low,
        epsilon_high=algo.clip_high,
        delta=algo.dual_clip_c,
        beta=algo.kl_loss_coef,
        # relax's TorchModel: torch AdamW (0.9, 0.999), eps 1e-8, constant lr after warm-up
        optim="adamw_torch",
        learning_rate=trainer.lr,
        weight_decay=trainer.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=trainer.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=trainer.warmup_steps,
        gradient_checkpointing=trainer.activation_checkpointing,
        # float32 on the CPU, nothing logged or saved anywhere
        use_cpu=True,
        bf16=False,
        fp16=False,
        use_vllm=False,
        report_to="none",
        push_to_hub=False,
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def make_step_clock():
    """A TrainerCallback that notes when each optimizer step ends, and the logged rewards."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.step_end_s: list[float] = []
            self.rewards: list[tuple[int, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.step_end_s.append(time.time())  # the CPU sampler's clock

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append((state.global_step, logs["reward"]))

    return StepClock()


def run_trl(cfg: RunConfig, steps: int, threads: int, root: Path) -> Result:
    try:
        from datasets import Dataset
        from transformers import PrinterCallback
        from trl import GRPOTrainer
    except ImportError as err:
        raise SystemExit(
            f"TRL is not installed ({err}): pip install -c constraints/ci.txt -e '.[bench]'"
        ) from None
    torch.set_num_threads(threads)
    model, tokenizer = warm_started_policy(cfg)
    start_accuracy = held_out_accuracy(cfg, model, tokenizer, root / "trl-eval")
    model.train()  # the engine of that eval left it in eval mode
    stream = prompt_stream(cfg, tokenizer, steps * cfg.rollout.prompts_per_step)
    check_same_prompt_ids(tokenizer, [record for _, record in stream[:64]])
    records = dict(stream)
    dataset = Dataset.from_dict(
        {"prompt": [r.prompt for _, r in stream], "data_index": [i for i, _ in stream]}
    )
    sampler = TreeCpuSampler(os.getpid(), "TRL").start()
    score = make_scorer(cfg, RunPaths(root / "trl-scorer").create(), torch.device("cpu"))
    clock = make_step_clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=relax_reward(score, records),
        args=trl_config(cfg, steps, root / "trl"),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # its per-log print would flood the output
    trainer.train()
    sampler.stop()
    score.close()
    first, last = clock.step_end_s[0], clock.step_end_s[-1]
    timed = len(clock.step_end_s) - 1
    completions = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    accuracy = held_out_accuracy(cfg, trainer.model, tokenizer, root / "trl-eval")
    print(f"  TRL training reward (logged every 10 steps): {format_rewards(clock.rewards)}")
    return Result(
        "TRL",
        timed,
        last - first,
        timed * completions,
        accuracy,
        start_accuracy,
        cpu_s=sampler.cpu_between(first, last),
    )


def check_same_prompt_ids(tokenizer, records: Sequence[PromptRecord]) -> None:
    """TRL tokenizes prompt text itself: it must give the ids relax_hpc generates from."""
    trl_ids = tokenizer(text=[r.prompt for r in records])["input_ids"]
    if trl_ids != [r.prompt_ids for r in records]:
        raise RuntimeError("TRL's prompt token ids differ from relax_hpc's")


def format_rewards(rewards: list[tuple[int, float]]) -> str:
    return " ".join(f"{step}:{value:.2f}" for step, value in rewards) or "none logged"


# --- relax_hpc ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """One phase of a relax_hpc step: the sum of ``timers`` minus ``minus`` of ``role``'s
    ``time/*`` scalars; no role: relax_hpc has no timer for it."""

    name: str
    role: str | None
    timers: tuple[str, ...] = ()
    minus: tuple[str, ...] = ()
    note: str = ""


PHASES = (
    # The rollout's generate timer encloses its score timer (rollout/loop.py).
    Phase("generation", "rollout-0", ("generate",), ("score",), "generate_s - score_s"),
    Phase("scoring", "rollout-0", ("score",)),
    Phase("publish", "rollout-0", ("write_shard",), note="shard write + rename + nudge"),
    Phase("hand-off", None, note="shard published -> trainer has claimed it"),
    Phase("old log-probs", "trainer", ("prepare",), note="prepare_step: log-probs + advantages"),
    Phase("training", "trainer", ("train",)),
    Phase("weight sync", "trainer", ("weight_sync",), note="the trainer's side of the sync"),
    Phase("idle: trainer", "trainer", ("wait_for_batch",), note="its batch wait (with hand-off)"),
    Phase("idle: rollout", "rollout-0", ("wait_for_weights",), note="with receive + load"),
)


def run_relax(mode: str, steps: int, root: Path) -> tuple[Result, dict[str, list[float]]]:
    """grpo_tiny via ``e2e_tiny``'s command line; its throughput, CPU per process,
    accuracy and per-step phase times."""
    command = e2e_tiny.submit_command(mode, steps, root, [f"rollout.eval_interval_steps={steps}"])
    process = subprocess.Popen(
        command, cwd=e2e_tiny.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    sampler = TreeCpuSampler(process.pid, "supervisor").start()
    _, stderr = process.communicate()
    sampler.stop()
    if process.returncode != 0:
        raise SystemExit(f"relax_hpc {mode} failed ({process.returncode}):\n{stderr[-3000:]}")
    run_dir = root / mode
    measured = e2e_tiny.measure(run_dir, target=1.0)
    evals = e2e_tiny.events(run_dir / "tensorboard" / "rollout-0")["eval/accuracy"]
    staleness = e2e_tiny.events(run_dir / "tensorboard" / "trainer")["staleness/max"]
    print(
        f"  relax_hpc {mode}: trained on batches up to "
        f"{max(e.value for e in staleness):.0f} policy versions old (max_staleness allows "
        f"{1 if mode == 'async' else 0})"
    )
    if evals[-1].step != steps:  # the rollout evaluates the policy it holds when it stops
        print(f"  note: relax_hpc's last eval is of policy_version {evals[-1].step}, not {steps}")
    result = Result(
        f"relax_hpc {mode}",
        steps - 1,
        measured["wall_s"],
        measured["samples"],
        measured["final_accuracy"],
        start_accuracy=evals[0].value,
        cpu_s=sampler.cpu_between(measured["start_time"], measured["end_time"]),
        generate_step_s=measured["generate_step_s"],
        train_step_s=measured["train_step_s"],
    )
    return result, phase_series(run_dir, steps)


def phase_series(run_dir: Path, steps: int) -> dict[str, list[float]]:
    """Every ``time/*`` series of both roles over the timed steps 2..``steps``: ``role:tag``
    -> seconds. The rollout logs batch k when it has written it for training step k; the
    batches after ``steps`` (async: one ahead, and the final eval) are not part of a step."""
    series = {}
    for role in ("trainer", "rollout-0"):
        for tag, points in e2e_tiny.events(run_dir / "tensorboard" / role).items():
            if tag.startswith("time/"):
                series[f"{role}:{tag}"] = [p.value for p in points if 2 <= p.step <= steps]
    return series


def phase_means(series: dict[str, list[float]]) -> dict[str, float | None]:
    """Mean seconds per step of each of ``PHASES`` (None: no timer)."""

    def mean(role: str, timer: str) -> float:
        values = series.get(f"{role}:time/{timer}_s", [])
        return statistics.fmean(values) if values else 0.0

    means: dict[str, float | None] = {}
    for phase in PHASES:
        if phase.role is None:
            means[phase.name] = None
            continue
        added = sum(mean(phase.role, timer) for timer in phase.timers)
        means[phase.name] = added - sum(mean(phase.role, timer) for timer in phase.minus)
    return means


# --- output ------------------------------------------------------------------------------------
def print_header(cfg: RunConfig, args: argparse.Namespace) -> None:
    r, t, a = cfg.rollout, cfg.trainer, cfg.algo.with_algorithm_defaults()
    print(
        f"grpo_tiny side by side, {args.steps} steps each: {r.prompts_per_step} prompts x "
        f"{r.n_samples_per_prompt} samples/step, lr {t.lr} constant, AdamW(0.9, 0.999, 1e-8, "
        f"wd {t.weight_decay}), grad clip {t.grad_clip}, temperature {r.temperature}, "
        f"max_new_tokens {r.max_new_tokens}, clip {a.clip_low}/{a.clip_high}, dual-clip "
        f"{a.dual_clip_c} (TRL delta), KL {a.kl_loss_coef}, token-mean (TRL dapo), "
        f"1 update/step, float32 on CPU"
    )
    print("mismatches TRL cannot express:")
    for mismatch in MISMATCHES:
        print(f"  - {mismatch}")
    print(
        "timed: end of step 1 to end of the last step; relax_hpc's held-out eval runs before "
        "step 1 and after the last step only (rollout.eval_interval_steps = --steps)"
    )


def print_result(result: Result) -> None:
    print(
        f"{result.name:16s}: {result.samples_per_s:7.1f} samples/s | {result.s_per_step:.3f} s/step "
        f"({result.steps_timed} steps in {result.wall_s:.1f} s) | "
        f"{result.cpu_s_per_sample * 1000:.2f} CPU ms/sample | final held-out accuracy "
        f"{result.final_accuracy:.1%} (start {result.start_accuracy:.1%})"
    )
    per_process = ", ".join(
        f"{name} {seconds:.2f}" for name, seconds in sorted(result.cpu_s.items()) if seconds
    )
    print(f"  CPU s in the timed steps, per process: {per_process}")


def print_phases(mode: str, series: dict[str, list[float]], s_per_step: float) -> None:
    means = phase_means(series)
    print(f"relax_hpc {mode} step, mean s/step from its timers (wall {s_per_step:.4f} s/step):")
    for phase in PHASES:
        value = means[phase.name]
        shown = "n/a (no timer)" if value is None else f"{value:.4f} s"
        print(f"  {phase.name:14s} {shown:16s} {phase.note}")
    print("  every timer relax_hpc logged (mean s/step; '-': none inside the timed steps):")
    for name, values in sorted(series.items()):
        shown = f"{statistics.fmean(values):.4f} s" if values else "-"
        print(f"    {name:34s} {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default="async,sync", help="relax_hpc modes, comma-separated")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-relax", action="store_true")
    parser.add_argument(
        "--trl-threads", type=int, default=2, help="torch threads of TRL (relax: 2 x 1)"
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is not timed)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = grpo_tiny_config(args.steps)
    print_header(cfg, args)
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average of this machine)")
    modes = [] if args.skip_relax else [m for m in args.modes.split(",") if m]
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="trl_side_by_side.") as tmp:
        for mode in modes:
            results[mode], series = run_relax(mode, args.steps, Path(tmp))
            print_result(results[mode])
            print_phases(mode, series, results[mode].s_per_step)
        if not args.skip_trl:
            results["trl"] = run_trl(cfg, args.steps, args.trl_threads, Path(tmp))
            print_result(results["trl"])
    report = build_report(results, args.steps)
    print_ratios(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def build_report(results: dict[str, Result], steps: int) -> dict:
    baseline = results.get("trl")
    return {
        "steps": steps,
        "load_1min": os.getloadavg()[0],
        "engines": {
            key: result.report(baseline if key != "trl" else None)
            for key, result in results.items()
        },
    }


def print_ratios(report: dict) -> None:
    engines = report["engines"]
    for key, figures in engines.items():
        if key == "trl":
            continue
        ratios = ""
        if "ratio_samples_per_s" in figures:
            target = TARGETS[key]
            ratios = (
                f"samples/s {figures['ratio_samples_per_s']:.2f}x TRL (target >= {target}), "
                f"s/step {figures['ratio_s_per_step']:.2f}x, CPU s/sample "
                f"{figures['ratio_cpu_s_per_sample']:.2f}x (target <= {TARGET_CPU_RATIO})"
            )
        print(f"relax_hpc {key}: {ratios}")
        if figures["overlap"] is not None and key == "async":
            print(
                f"  overlap: step {figures['s_per_step']:.3f} s / max(generation "
                f"{figures['generate_step_s']:.3f}, training {figures['train_step_s']:.3f}) = "
                f"{figures['overlap']:.2f} (target <= {TARGET_OVERLAP})"
            )
            busy = figures["cores_busy_by_process"]
            shown = ", ".join(
                f"{name} {busy[name]:.2f}" for name in sorted(busy) if busy[name] > 0.01
            )
            print(f"  cores busy (CPU s / wall s of the timed steps): {shown}")
    print(f"load after: {report['load_1min']:.2f} (1-min average of this machine)")


if __name__ == "__main__":
    main()
