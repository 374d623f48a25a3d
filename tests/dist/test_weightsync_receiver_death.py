"""Receivers SIGKILLed at every phase of a sync, with the default ``timeout_s``.

Two healthy engines and one victim per death join one trainer; sync k kills victim k at
its phase (ready, group formation, mid-transfer, after the transfer, inside the load
callback). Every sync must drop the victim and no one else, bring every healthy engine
(the victims still waiting their turn included) to the new version, and return within
the sender's stated bounds: ``timeout_s + FAILURE_GRACE_S`` plus its retry round for any
death, and, the victims being processes whose kernel closes their sockets, within
``FAILURE_GRACE_S`` plus its retry round (``RETRY_ROUND_S``): the timeout (the default
60 s) is never waited out.

``WEIGHTSYNC_DEATH_TIMEOUT_S`` and ``WEIGHTSYNC_DEATH_ROUNDS`` change the timeout and the
number of deaths per phase.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from weightsync_peers import (
    expected_fingerprint,
    make_state,
    read_status,
    spawn_engine,
    stop_engines,
    wait_until,
)

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import WeightSender, WeightSyncConfig
from relax_hpc.weightsync.sender import FAILURE_GRACE_S

PHASES = ("ready", "formation", "transfer", "verify", "load")
ROUNDS = int(os.environ.get("WEIGHTSYNC_DEATH_ROUNDS", "2"))
TIMEOUT_S = float(os.environ.get("WEIGHTSYNC_DEATH_TIMEOUT_S", WeightSyncConfig.timeout_s))
RETRY_ROUND_S = 15.0  # one more round for the survivors (group formation + transfer), 2 cores
STARTUP_S = 180  # a dozen engine processes import torch on 2 shared cores
HEALTHY = ("h1", "h2")


def _config() -> WeightSyncConfig:
    return WeightSyncConfig(
        backend="gloo",
        timeout_s=TIMEOUT_S,
        bucket_mb=1,
        serve_dtype="bfloat16",
        fs_fallback=False,
        advertise_host="127.0.0.1",
    )


def _await_admitted(sender: WeightSender, engine_ids: list[str]) -> None:
    def all_admitted() -> bool:
        sender.admit_pending()
        return set(engine_ids) <= set(sender.admitted_engines)

    wait_until(all_admitted, STARTUP_S, f"admission of {engine_ids}")


def _deaths(phases=PHASES) -> list[tuple[str, str, int]]:
    """(victim id, phase, the version it dies in); version 1 is a sync without deaths."""
    schedule = [phase for _ in range(ROUNDS) for phase in phases]
    return [(f"v{i}-{phase}", phase, i + 2) for i, phase in enumerate(schedule)]


def _run_deaths(
    tmp_path, deaths: list[tuple[str, str, int]], late_joiner: bool = False
) -> list[tuple[str, float]]:
    """Sync version 1, then one version per death; ``late_joiner``: an engine joins between
    versions 1 and 2, so that version 2 forms a new group."""
    paths = RunPaths(tmp_path).create()
    config = _config()
    sender = WeightSender(paths, config, "cpu")
    sender.start()
    processes = [spawn_engine(paths.root, engine_id, config) for engine_id in HEALTHY]
    processes += [
        spawn_engine(paths.root, victim, config, mode=f"die:{phase}:{version}")
        for victim, phase, version in deaths
    ]
    try:
        alive = [*HEALTHY, *(victim for victim, _, _ in deaths)]
        _await_admitted(sender, alive)
        assert sorted(sender.sync(make_state(1), 1).members) == sorted(alive)
        if late_joiner:
            processes.append(spawn_engine(paths.root, "late", config))
            _await_admitted(sender, ["late"])
            alive.append("late")
        any_death_bound_s = config.timeout_s + FAILURE_GRACE_S + RETRY_ROUND_S
        process_death_bound_s = FAILURE_GRACE_S + RETRY_ROUND_S
        seconds = []
        for victim, phase, version in deaths:
            alive.remove(victim)
            report = sender.sync(make_state(version), version)
            seconds.append((phase, report.seconds))
            assert report.dropped == [victim], (phase, report)
            assert sorted(report.members) == sorted(alive), (phase, report)
            assert report.seconds <= any_death_bound_s, (phase, report.seconds)
            assert report.seconds <= process_death_bound_s, (phase, report.seconds)
            dying = [r for r in read_status(paths.root, victim) if r["event"] == "dying"]
            assert [r["phase"] for r in dying] == [phase], "the victim died where it should"
        last = deaths[-1][2]
        for engine_id in alive:
            record = wait_until(
                lambda e=engine_id: [
                    r
                    for r in read_status(paths.root, e)
                    if r["event"] == "update" and r["version"] == last
                ],
                30,
                f"{engine_id} at policy_version {last}",
            )
            assert record[-1]["fingerprint"] == expected_fingerprint(last, torch.bfloat16)
        return seconds
    finally:
        sender.close()
        stop_engines(paths.root, processes)


def _report(seconds: list[tuple[str, float]]) -> None:
    for phase in dict.fromkeys(p for p, _ in seconds):
        times = [s for p, s in seconds if p == phase]
        print(f"death at {phase:<9}: {len(times)} syncs, sender wait max {max(times):.2f} s")
    print(
        f"bounds: any death {TIMEOUT_S + FAILURE_GRACE_S + RETRY_ROUND_S:.0f} s (timeout_s "
        f"{TIMEOUT_S:.0f} s), a dead process {FAILURE_GRACE_S + RETRY_ROUND_S:.0f} s"
    )


@pytest.mark.slow
def test_receiver_deaths_at_every_phase_cost_a_bounded_wait_and_no_healthy_engine(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="relax_hpc.weightsync")
    seconds = _run_deaths(tmp_path, _deaths())
    _report(seconds)
    assert len(seconds) == len(PHASES) * ROUNDS


def test_a_receiver_dying_mid_broadcast_drops_no_healthy_one(tmp_path):
    _report(_run_deaths(tmp_path, [("v-transfer", "transfer", 2)]))


def test_a_receiver_dying_while_the_group_forms_costs_a_bounded_wait(tmp_path):
    _report(_run_deaths(tmp_path, [("v-formation", "formation", 2)], late_joiner=True))
