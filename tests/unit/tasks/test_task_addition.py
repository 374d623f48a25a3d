"""The cached warm start: deterministic, keyed by its inputs, published atomically."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tiny_models import tiny_qwen3_arch, tiny_qwen3_config

from relax_hpc.config.schema import DataConfig
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.tasks import addition
from relax_hpc.tasks.addition import WarmStartConfig, warm_start
from relax_hpc.tasks.warm_start import (
    LOCKS_DIR,
    progress_reports,
    supervised_batch,
    warm_started_model_config,
)

ARCH = tiny_qwen3_arch(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, head_dim=8, max_position_embeddings=32
)
MODEL = tiny_qwen3_config(ARCH)
DATA = DataConfig(kind="synthetic_addition", digits=1, eval_size=10, apply_chat_template=False)
RECIPE = WarmStartConfig(steps=3, batch_size=8, warmup_steps=1)


def test_warm_start_is_cached_deterministic_and_keyed(tmp_path, monkeypatch):
    folder = warm_start(MODEL, DATA, tmp_path / "a", RECIPE)
    metadata = json.loads((folder / "warmstart.json").read_text())
    assert metadata["inputs"]["recipe"]["steps"] == 3
    names = [p.name for p in (tmp_path / "a").iterdir() if p.name != LOCKS_DIR]
    assert names == [folder.name]  # no temp folder left
    again = warm_start(MODEL, DATA, tmp_path / "b", RECIPE)
    assert again.name == folder.name
    cfg = warm_started_model_config(MODEL, folder)
    weights = build_causal_lm(cfg, build_tokenizer(cfg)).state_dict()
    other_weights = build_causal_lm(
        warm_started_model_config(MODEL, again), build_tokenizer(cfg)
    ).state_dict()
    assert all(torch.equal(weights[k], other_weights[k]) for k in weights)

    monkeypatch.setattr(addition, "train_on_sloppy_teacher", lambda *a: pytest.fail("not cached"))
    assert warm_start(MODEL, DATA, tmp_path / "a", RECIPE) == folder
    monkeypatch.undo()
    seed_changed = warm_start(MODEL, DATA, tmp_path / "a", dataclasses.replace(RECIPE, seed=1))
    digits_changed = warm_start(MODEL, dataclasses.replace(DATA, digits=2), tmp_path / "a", RECIPE)
    assert len({folder, seed_changed, digits_changed}) == 3


def test_supervised_batch_labels_only_answer_and_eos():
    tokenizer = build_char_tokenizer()
    input_ids, labels = supervised_batch(tokenizer, ["1+2=", "10+20="], ["3", "03"])
    assert tokenizer.decode(input_ids[0]) == "<bos>1+2=3<eos><pad><pad><pad>"
    assert tokenizer.decode([t for t in labels[1].tolist() if t != -100]) == "03<eos>"


def test_warm_start_refuses_other_data_or_a_model_path(tmp_path):
    with pytest.raises(ValueError, match="synthetic_addition"):
        warm_start(MODEL, DataConfig(kind="jsonl"), tmp_path, RECIPE)
    with pytest.raises(ValueError, match="model.path"):
        warm_start(dataclasses.replace(MODEL, path="x"), DATA, tmp_path, RECIPE)


def test_a_warm_start_reports_its_progress_to_whoever_listens(tmp_path):
    reports = []
    recipe = dataclasses.replace(RECIPE, steps=12)
    with progress_reports(lambda *progress: reports.append(progress)):
        warm_start(MODEL, DATA, tmp_path, recipe)
    assert [(step, total) for step, total, _ in reports] == [(10, 12), (12, 12)]
    assert all(loss > 0 for _, _, loss in reports)
    warm_start(MODEL, DATA, tmp_path, recipe)  # cached, and nobody listens: no reports
    assert len(reports) == 2


def test_the_trainers_warm_start_writes_the_runs_status(tmp_path):
    from relax_hpc.config.schema import RunConfig
    from relax_hpc.paths import RunPaths, read_json
    from relax_hpc.trainer.networks import warm_start_progress

    run = RunPaths(tmp_path / "run").create()
    with warm_start_progress(RunConfig(name="t", run_dir=str(run.root))):
        warm_start(MODEL, DATA, tmp_path / "cache", dataclasses.replace(RECIPE, steps=10))
    status = read_json(run.warm_start_status)
    assert (status["phase"], status["step"], status["total_steps"]) == ("warm start", 10, 10)
    assert status["loss"] > 0 and status["elapsed_s"] >= 0
