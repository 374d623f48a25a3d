"""SpoolConfig validation names the offending field as ``spool.<field>``."""

from __future__ import annotations

import pytest

from relax_hpc.spool import SpoolConfig


def test_defaults_are_valid() -> None:
    assert SpoolConfig().validate() == SpoolConfig()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shard_max_samples", 0),
        ("max_staleness", -2),
        ("poll_s", 0.0),
        ("max_ready_groups", 0),
        ("tmp_max_age_s", -1.0),
        ("ledger_keep_steps", -1),
    ],
)
def test_invalid_values_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^spool\.{field} must be"):
        SpoolConfig(**{field: value}).validate()
