"""Fixtures of the end-to-end tests (their helpers are in e2e_helpers.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def its_run(request, result_of):
    """(run_dir, result) of this test's run, from its module's ``result_of`` fixture
    (``e2e_helpers.runs_of_selected_tests``)."""
    return result_of(request.node.originalname)
