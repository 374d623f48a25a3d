"""Which parallel layouts a Megatron checkpoint resumes under (pure checks, no megatron)."""

from __future__ import annotations

import pytest

from relax_hpc.config.errors import ConfigError
from relax_hpc.trainer.megatron.layout import (
    LAYOUT_FILE,
    CheckpointLayout,
    CheckpointLayoutError,
    check_resumable,
    read_layout,
    write_layout,
)

SAVED = CheckpointLayout(tensor=2, pipeline=2, expert=1, context=1, data=4)


def test_dp_reshardable_resumes_with_another_data_size_only(tmp_path):
    check_resumable(SAVED, CheckpointLayout(tensor=2, pipeline=2, data=8), tmp_path)
    for changed in ({"tensor": 4}, {"pipeline": 1}, {"expert": 2}, {"context": 2}):
        current = CheckpointLayout(**{**SAVED.__dict__, **changed})
        with pytest.raises(CheckpointLayoutError) as err:
            check_resumable(SAVED, current, tmp_path)
        name, value = next(iter(changed.items()))
        message = str(err.value)
        assert f"{name} {getattr(SAVED, name)} -> {value}" in message, message
        assert "fully_reshardable" in message and str(tmp_path) in message
        assert isinstance(err.value, ConfigError) and err.value.field == "trainer.parallel"


def test_fully_reshardable_resumes_under_any_layout(tmp_path):
    saved = CheckpointLayout(format="fully_reshardable", tensor=8, pipeline=4, expert=2, data=2)
    check_resumable(saved, CheckpointLayout(), tmp_path)


def test_layout_round_trips_through_its_file_and_old_checkpoints_have_none(tmp_path):
    assert read_layout(tmp_path) is None  # written before layouts were recorded
    write_layout(tmp_path, SAVED)
    assert read_layout(tmp_path) == SAVED
    assert not [p for p in tmp_path.iterdir() if p.name != LAYOUT_FILE]  # no temp left


def test_a_damaged_record_or_unknown_format_is_named(tmp_path):
    (tmp_path / LAYOUT_FILE).write_text('{"format": "dp_reshardable", "tensr": 2}')
    with pytest.raises(CheckpointLayoutError, match="unreadable layout record"):
        read_layout(tmp_path)
    with pytest.raises(CheckpointLayoutError, match="unknown Megatron checkpoint format 'x'"):
        CheckpointLayout(format="x")
