"""Every way a model arrives trains in every mode: built in, or a user's folder.

The matrix is ``mode`` (sync, hybrid, async) x model source: the built-in model (built from
config), a folder written by the installed transformers 4, a folder in transformers 5's
layout (``tokenizer_class: TokenizersBackend``) and a folder of several safetensors shards.
The built-in model's column is checked on the runs of ``test_algorithm_families`` that
check each mode (``e2e_helpers.check_the_model_trained_in_the_mode``), which train it already.
A folder's weights are memory-mapped from its files, which torch cannot resize: ``mode=sync``
releases the engine's memory after every batch and used to crash there, restart, and crash
again. Each cell is ``submit`` with ``cluster=local`` for three steps of 2x2 samples: the
rollout releases its memory (sync), takes new weights from the trainer while released,
generates with them and releases again; in every mode the last batch comes from trained
weights (three steps: async may generate two batches ahead of them).
"""

from __future__ import annotations

import functools

import pytest
from e2e_helpers import (
    check_the_model_trained_in_the_mode,
    selected_params,
    submit,
    two_at_a_time,
)
from tiny_models import write_transformers5_folder

from relax_hpc.config.compose import compose_run_config
from relax_hpc.models.build import build_causal_lm, build_tokenizer

THREE_SMALL_STEPS = (
    "model.warm_start=false",
    "trainer.total_steps=3",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.eval_interval_steps=0",
    "data.eval_size=2",
)
MODES = {"sync": 0, "hybrid": 0, "async": 1}  # mode -> max_staleness


def save_folder(folder, **save) -> None:
    """grpo_tiny's model and tokenizer as ``save_pretrained`` writes them (transformers 4)."""
    tiny = compose_run_config(["+experiment=grpo_tiny"]).model
    tokenizer = build_tokenizer(tiny)
    build_causal_lm(tiny, tokenizer, seed=3).save_pretrained(folder, **save)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    """Model source -> its folder."""
    root = tmp_path_factory.mktemp("model-sources")
    save_folder(root / "transformers4")
    save_folder(root / "sharded", max_shard_size="100KB")
    assert len(list((root / "sharded").glob("model-*-of-*.safetensors"))) > 1
    (root / "transformers5").mkdir()
    write_transformers5_folder(root / "transformers5")
    return {
        "transformers4": root / "transformers4",
        "transformers5": root / "transformers5",
        "sharded": root / "sharded",
    }


def model_overrides(folder) -> list[str]:
    return [f"model.path={folder}", f"model.tokenizer={folder}"]


@pytest.fixture(scope="module")
def run_of(request, tmp_path_factory, folders):
    """``run_of(mode, source)`` -> (run_dir, result): the selected cells, two at a time."""

    def run(mode: str, source: str) -> tuple:
        run_dir = tmp_path_factory.mktemp(f"{mode}-{source}") / "run"
        overrides = (f"mode={mode}", f"max_staleness={MODES[mode]}", *THREE_SMALL_STEPS)
        return run_dir, submit(
            run_dir, *overrides, *model_overrides(folders[source]), timeout_s=300
        )

    cells = selected_params(request, "mode", "source")
    with two_at_a_time({cell: functools.partial(run, *cell) for cell in cells}) as runs:
        yield lambda mode, source: runs[(mode, source)].result()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["transformers4", "transformers5", "sharded"])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_model_trains_in_the_mode(mode, source, run_of):
    run_dir, result = run_of(mode, source)
    check_the_model_trained_in_the_mode(run_dir, result, mode, steps=3)
