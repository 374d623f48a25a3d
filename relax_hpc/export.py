"""``python -m relax_hpc.export RUN_DIR [--step N] --out DIR``: a checkpoint as a Hugging
Face folder (config, safetensors weights, tokenizer) that ``transformers`` loads.

Reads the run's resolved config for the architecture and tokenizer, loads the policy
weights of the checkpoint (the latest complete one by default) and saves them. A model
that reads images or audio also gets its processor files (``preprocessor_config.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

import torch

from relax_hpc import exitcodes
from relax_hpc.checkpoint.stateful import ModelAndOptimizer
from relax_hpc.checkpoint.store import CheckpointStore, complete_checkpoints
from relax_hpc.config import ConfigError, load_run_config
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.models.media_policy import build_media_policy, is_media_model
from relax_hpc.paths import RunPaths


def export_checkpoint(run_dir: Path, out_dir: Path, step: int | None = None) -> Path:
    paths = RunPaths(run_dir)
    cfg = load_run_config(paths.resolved_config)
    checkpoints = {info.step: info for info in complete_checkpoints(paths)}
    if not checkpoints:
        raise ValueError(f"{paths.checkpoints_dir} holds no complete checkpoint yet")
    chosen = max(checkpoints) if step is None else step
    if chosen not in checkpoints:
        raise ValueError(f"no complete checkpoint of step {chosen}; have {sorted(checkpoints)}")
    if is_media_model(cfg.model):
        # the checkpoint holds every weight: the warm start need not be rebuilt
        skeleton = dataclasses.replace(cfg.model, warm_start=False)
        model, tokenizer = build_media_policy(skeleton, torch.float32, seed=cfg.seed)
    else:
        tokenizer = build_tokenizer(cfg.model)
        model = build_causal_lm(cfg.model, tokenizer, torch.float32, seed=cfg.seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        CheckpointStore(paths, keep=1).load(
            checkpoints[chosen], {"policy": ModelAndOptimizer(model, None)}
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)  # a MediaProcessor writes its processor files too
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.export", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--step", type=int, default=None, help="checkpoint step (default: the latest)"
    )
    parser.add_argument("--out", type=Path, required=True, help="destination folder")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.out, args.step)
    except (ValueError, ConfigError) as err:
        print(f"relax_hpc export: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    print(f"relax_hpc export: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
