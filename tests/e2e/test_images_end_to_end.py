"""Image prompts through ``submit`` as a user runs them (#28 acceptance): a Geometry3K
Parquet written here (PNG bytes, ``<image>`` in the problem, one corrupt image) flows
through a short run; the corrupt row is skipped, logged and counted while the run goes on;
a trainer killed with SIGKILL mid-run resumes and trains every sample, images and all,
exactly once. The model is the tiny Qwen3-VL of ``grpo_tiny_vl``.
"""

from __future__ import annotations

import functools
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from e2e_helpers import (
    check_sigkilled_media_run,
    failure_report,
    runs_of_selected_tests,
    scalars,
    sigkilled_media_run,
    submit,
    trained_and_published,
)
from PIL import Image

from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import check_exactly_once

pytestmark = pytest.mark.slow

VL = "grpo_tiny_vl"
SMALL = [
    "model.warm_start=false",  # the plumbing, not learning: no warm start to wait for
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=2",
    "rollout.eval_interval_steps=0",
    "observe.audit_sample_ids=true",
    "spool.keep_consumed=true",
]
CORRUPT_ROW = 2


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_geometry3k(path, num_rows: int) -> None:
    """Geometry3K's published layout: ``images`` a list of ``{bytes, path}`` structs (the
    Hugging Face ``Image`` feature), ``problem`` with an ``<image>`` mark, ``answer``."""
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    types = pa.schema(
        [("images", pa.list_(image)), ("problem", pa.string()), ("answer", pa.string())]
    )
    rows = [
        {
            "images": [
                {"bytes": b"\x89PNG not an image" if i == CORRUPT_ROW else png(i), "path": None}
            ],
            "problem": f"<image>Find x. ({i})",
            "answer": str(i % 4 + 1),
        }
        for i in range(num_rows)
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=types), path)


def corrupt_row_run(run_dir):
    data = run_dir.parent / "geo3k.parquet"
    write_geometry3k(data, num_rows=10)
    return submit(
        run_dir,
        *SMALL,
        "data=geo3k",
        f"data.path={data}",
        "data.shuffle=false",  # rows in order: the corrupt one is drawn in the first step
        "rollout.reward=geo3k",
        "trainer.total_steps=2",
        experiment=VL,
        timeout_s=600,
    )


def multi_turn_run(run_dir):
    return submit(
        run_dir,
        *SMALL,
        "rollout.environment=brighter",
        "trainer.total_steps=2",
        experiment=VL,
        timeout_s=600,
    )


@pytest.fixture(scope="module")
def result_of(request, tmp_path_factory):
    """The module's runs share nothing, so they run two at a time (a tiny run leaves one of
    the two cores idle most of the time)."""
    runs = {
        test_a_geometry3k_parquet_with_a_corrupt_image_trains_and_counts_the_row: corrupt_row_run,
        test_a_sigkilled_trainer_resumes_and_trains_every_image_sample_once: functools.partial(
            sigkilled_media_run, small=SMALL, experiment=VL
        ),
        test_a_multi_turn_image_episode_runs_through_submit: multi_turn_run,
    }
    with runs_of_selected_tests(request, tmp_path_factory, runs) as result_of:
        yield result_of


def test_a_geometry3k_parquet_with_a_corrupt_image_trains_and_counts_the_row(its_run):
    run_dir, result = its_run
    paths = RunPaths(run_dir)
    assert result.returncode == 0, failure_report(result, run_dir)
    assert read_json(paths.trainer_done)["step"] == 2
    log = paths.task_log("rollout", 0).read_text()
    assert f"row {CORRUPT_ROW} skipped (1 so far)" in log, log[-3000:]
    rollout = scalars(RunPaths(run_dir).rollout_tensorboard_dir(0))
    assert rollout["data/train_rows_skipped"][-1] == 1
    trained, samples = trained_and_published(paths)
    assert len(trained) == 2 and all(len(step) == 4 * 2 for step in trained)
    assert samples and all(s.media is not None and len(s.media.images) == 1 for s in samples)
    assert CORRUPT_ROW not in {s.data_index for s in samples}


def test_a_sigkilled_trainer_resumes_and_trains_every_image_sample_once(its_run):
    check_sigkilled_media_run(*its_run, "images")


def test_a_multi_turn_image_episode_runs_through_submit(its_run):
    """``brighter`` shows image A, then image B, then asks which was brighter: each trained
    sample holds both images (the first turn's reaches the second turn's prompt), its
    observation tokens carry no loss, and every sample is trained once."""
    run_dir, result = its_run
    paths = RunPaths(run_dir)
    assert result.returncode == 0, failure_report(result, run_dir)
    trained, samples = trained_and_published(paths)
    assert len(trained) == 2 and all(len(step) == 4 * 2 for step in trained)
    published = {sample.sample_id for sample in samples}
    assert not check_exactly_once(published | {s for step in trained for s in step}, trained)
    for sample in samples:
        assert sample.num_turns == 2
        first, second = sample.media.images
        assert first.std() == 0 and second.std() == 0 and first.mean() != second.mean()
        assert 0 < sample.loss_mask.sum() < len(sample.loss_mask)  # observations masked out
