"""Audio prompts through ``submit`` as a user runs them (#30 acceptance): a JSONL of chat rows
whose clips are WAV files beside it (one truncated) flows through a short run of the tiny
Omni thinker; the truncated row is skipped, logged and counted while the run goes on; a
trainer killed with SIGKILL mid-run resumes and trains every sample, clips and all, exactly
once. The model is the tiny Qwen2.5-Omni thinker of ``grpo_tiny_omni``.
"""

from __future__ import annotations

import functools
import io
import json

import numpy as np
import pytest
import soundfile
from e2e_helpers import (
    check_sigkilled_media_run,
    failure_report,
    runs_of_selected_tests,
    scalars,
    sigkilled_media_run,
    submit,
    trained_and_published,
)

from relax_hpc.paths import RunPaths, read_json

pytestmark = pytest.mark.slow

OMNI = "grpo_tiny_omni"
SMALL = [
    "model.warm_start=false",  # the plumbing, not learning: no warm start to wait for
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=2",
    "rollout.eval_interval_steps=0",
    "observe.audit_sample_ids=true",
    "spool.keep_consumed=true",
]
TRUNCATED_ROW = 2
PITCHES_HZ = (250.0, 500.0, 1000.0, 2000.0)


def wav(seconds: float, frequency_hz: float, rate_hz: int = 22050) -> bytes:
    t_s = np.arange(int(seconds * rate_hz)) / rate_hz
    out = io.BytesIO()
    soundfile.write(out, 0.3 * np.sin(2 * np.pi * frequency_hz * t_s), rate_hz, format="WAV")
    return out.getvalue()


def write_audio_rows(folder, num_rows: int):
    """Chat rows with a typed audio part; clips as WAV files at 22.05 kHz (resampled to the
    feature extractor's 16 kHz) named by paths relative to the JSONL; one cut in half."""
    (folder / "clips").mkdir(parents=True)
    rows = []
    for i in range(num_rows):
        clip = wav(0.5, PITCHES_HZ[i % 4])
        if i == TRUNCATED_ROW:
            clip = clip[: len(clip) // 2]
        (folder / "clips" / f"{i}.wav").write_bytes(clip)
        content = [{"type": "audio"}, {"type": "text", "text": f"Which pitch? (1-4) [{i}]"}]
        rows.append(
            {
                "prompt": [{"role": "user", "content": content}],
                "audio": {"bytes": None, "path": f"clips/{i}.wav"},
                "answer": str(i % 4 + 1),
            }
        )
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def truncated_wav_run(run_dir):
    data = write_audio_rows(run_dir.parent / "data", num_rows=10)
    return submit(
        run_dir,
        *SMALL,
        "data.kind=jsonl",
        f"data.path={data}",
        "data.shuffle=false",  # rows in order: the truncated one is drawn in the first step
        "trainer.total_steps=2",
        experiment=OMNI,
        timeout_s=600,
    )


@pytest.fixture(scope="module")
def result_of(request, tmp_path_factory):
    """The module's two runs share nothing, so they run side by side (a tiny run leaves one
    of the two cores idle most of the time)."""
    runs = {
        test_audio_rows_with_a_truncated_wav_train_and_count_the_row: truncated_wav_run,
        test_a_sigkilled_trainer_resumes_and_trains_every_audio_sample_once: functools.partial(
            sigkilled_media_run, small=SMALL, experiment=OMNI
        ),
    }
    with runs_of_selected_tests(request, tmp_path_factory, runs) as result_of:
        yield result_of


def test_audio_rows_with_a_truncated_wav_train_and_count_the_row(its_run):
    run_dir, result = its_run
    paths = RunPaths(run_dir)
    assert result.returncode == 0, failure_report(result, run_dir)
    assert read_json(paths.trainer_done)["step"] == 2
    log = paths.task_log("rollout", 0).read_text()
    assert f"row {TRUNCATED_ROW} skipped (1 so far)" in log and "truncated WAV" in log
    rollout = scalars(paths.rollout_tensorboard_dir(0))
    assert rollout["data/train_rows_skipped"][-1] == 1
    trained, samples = trained_and_published(paths)
    assert len(trained) == 2 and all(len(step) == 4 * 2 for step in trained)
    assert samples and all(len(s.media.audio) == 1 for s in samples)
    assert all(len(s.media.audio[0]) == 8000 for s in samples)  # 0.5 s at 16 kHz
    assert TRUNCATED_ROW not in {s.data_index for s in samples}


def test_a_sigkilled_trainer_resumes_and_trains_every_audio_sample_once(its_run):
    check_sigkilled_media_run(*its_run, "audio")
