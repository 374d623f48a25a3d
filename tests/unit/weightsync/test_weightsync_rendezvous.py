"""Rendezvous files (modes, atomicity, ownership), token proofs, and the config contract."""

from __future__ import annotations

import dataclasses
import stat

import pytest

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import WeightSyncConfig, rendezvous


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_trainer_file_is_private_and_round_trips(tmp_path):
    paths = RunPaths(tmp_path).create()
    endpoint = rendezvous.TrainerEndpoint("node1", 1234, rendezvous.new_token(), "abc", 42)
    path = rendezvous.publish_trainer_endpoint(paths, endpoint)
    assert _mode(path) == 0o600
    assert _mode(paths.rendezvous_dir) == 0o700
    assert rendezvous.read_trainer_endpoint(paths) == endpoint
    assert rendezvous.existing_token(paths) == endpoint.token
    assert not list(paths.rendezvous_dir.glob("*.tmp"))


def test_missing_trainer_file_times_out_with_its_path(tmp_path):
    paths = RunPaths(tmp_path).create()
    with pytest.raises(rendezvous.WeightSyncTimeout, match="trainer.json"):
        rendezvous.wait_for_trainer_endpoint(paths, timeout_s=0.05, poll_s=0.01)


def test_an_engine_waits_for_the_trainer_of_its_own_job_start(tmp_path):
    """A requeued job's engine must not dial the dead address of the previous start."""
    paths = RunPaths(tmp_path).create()
    token = rendezvous.new_token()
    old = rendezvous.TrainerEndpoint("node1", 1111, token, "a", 1, attempt="77.0")
    rendezvous.publish_trainer_endpoint(paths, old)
    with pytest.raises(rendezvous.WeightSyncTimeout, match="found one of start '77.0'"):
        rendezvous.wait_for_trainer_endpoint(paths, timeout_s=0.05, poll_s=0.01, attempt="77.1")
    new = rendezvous.TrainerEndpoint("node1", 2222, token, "b", 2, attempt="77.1")
    rendezvous.publish_trainer_endpoint(paths, new)
    found = rendezvous.wait_for_trainer_endpoint(paths, timeout_s=1, poll_s=0.01, attempt="77.1")
    assert found.port == 2222
    assert rendezvous.wait_for_trainer_endpoint(paths, 1, 0.01) == new  # no attempt: any
    # a rollout task kept across a restart of the trainer alone takes the later start's
    assert rendezvous.wait_for_trainer_endpoint(paths, 1, 0.01, attempt="77.0") == new
    with pytest.raises(rendezvous.WeightSyncTimeout):  # another job's, even a later one
        rendezvous.wait_for_trainer_endpoint(paths, timeout_s=0.05, poll_s=0.01, attempt="78.0")


def test_same_or_later_start():
    assert rendezvous.same_or_later_start("local-9.3", "local-9.1")
    assert rendezvous.same_or_later_start("12.10", "12.9")  # numbers, not strings
    assert not rendezvous.same_or_later_start("12.0", "12.1")
    assert not rendezvous.same_or_later_start("13.2", "12.1")
    assert not rendezvous.same_or_later_start("x", "12.1")


def test_engine_registration_is_private_and_only_its_owner_removes_it(tmp_path):
    paths = RunPaths(tmp_path).create()
    old = rendezvous.EngineRegistration("e1", "inc1", "trainer", "node2", 7)
    new = rendezvous.EngineRegistration("e1", "inc2", "trainer", "node2", 8)
    path = rendezvous.register_engine(paths, old)
    assert _mode(path) == 0o600
    rendezvous.register_engine(paths, new)  # a restarted engine replaces the file
    rendezvous.deregister_engine(paths, old)
    assert rendezvous.list_engine_registrations(paths) == [new]
    rendezvous.deregister_engine(paths, new)
    assert rendezvous.list_engine_registrations(paths) == []


def test_proofs_depend_on_the_token_and_the_member():
    token, other = rendezvous.new_token(), rendezvous.new_token()
    proof = rendezvous.hello_proof(token, "e1.x")
    assert rendezvous.verify_signature(token, b"hello|e1.x", proof)
    assert not rendezvous.verify_signature(other, b"hello|e1.x", proof)
    assert not rendezvous.verify_signature(token, b"hello|e2.x", proof)
    assert rendezvous.admit_proof(token, "e1.x") != proof


def test_config_defaults_validate():
    assert WeightSyncConfig().validate() == WeightSyncConfig()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("backend", "mpi"),
        ("timeout_s", 0),
        ("bucket_mb", 0),
        ("interval_steps", 0),
        ("serve_dtype", "fp8"),
        ("fs_every_syncs", -1),
        ("fs_keep_versions", 0),
        ("port", 70000),
        ("poll_s", 0),
    ],
)
def test_config_errors_name_the_field(field, value):
    config = WeightSyncConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"^weightsync\.{field}="):
        config.validate()


def test_signed_messages_verify_only_unchanged_and_in_their_place():
    token = rendezvous.new_token()
    value = rendezvous.sign_message(token, {"round": 3, "member": "e1.x", "msg": "ready"})
    assert rendezvous.open_message(token, value, round=3, member="e1.x")["msg"] == "ready"
    assert rendezvous.open_message(token, value, round=4) is None, "replayed into round 4"
    assert rendezvous.open_message(token, value, member="e2.y") is None, "another member's"
    assert rendezvous.open_message(rendezvous.new_token(), value) is None, "another token"
    tampered = value.replace('"ready"', '"result"')
    for bad in (tampered, value[: len(value) // 2], "{}", "not json", b"\xff"):
        assert rendezvous.open_message(token, bad) is None


def test_a_registration_file_under_another_members_name_is_ignored(tmp_path):
    paths = RunPaths(tmp_path).create()
    live = rendezvous.EngineRegistration("e1", "inc1", "trainer", "node2", 7)
    rendezvous.register_engine(paths, live)
    intruder = rendezvous.EngineRegistration("e1", "inc2", "trainer", "node3", 9)
    rendezvous.register_engine(paths, intruder)  # same engine id: its own file, not e1's
    (rendezvous.engines_dir(paths) / "e1.inc3.json").write_text(
        rendezvous.json.dumps(dataclasses.asdict(intruder))
    )
    assert rendezvous.list_engine_registrations(paths) == [live, intruder]
    rendezvous.deregister_engine(paths, intruder)
    assert rendezvous.list_engine_registrations(paths) == [live]
