"""The shared signing primitive and published-address files (weight sync and judge use both)."""

from __future__ import annotations

import stat
from dataclasses import dataclass

from relax_hpc.address_files import publish_record, read_record, read_records
from relax_hpc.rollout.rewards.protocol import sign_body, signature_valid
from relax_hpc.signing import hmac_hex, hmac_matches
from relax_hpc.weightsync import rendezvous


@dataclass(frozen=True)
class Point:
    host: str
    port: int


def test_one_hmac_serves_the_rendezvous_and_the_reward_protocol():
    token, body = "ab" * 32, b'{"items": []}'
    assert rendezvous.sign(token, body) == hmac_hex(token, body)
    assert sign_body(token, body) == "sha256=" + hmac_hex(token, body)
    assert signature_valid(token, body, sign_body(token, body))
    assert not signature_valid(token, body + b" ", sign_body(token, body))
    assert not signature_valid(token, body, hmac_hex(token, body))  # the prefix is required
    assert not signature_valid(token, body, None)
    assert hmac_matches(token, body, hmac_hex(token, body))
    assert not hmac_matches("cd" * 32, body, hmac_hex(token, body))
    assert not hmac_matches(token, body, None)


def test_a_record_is_private_and_read_back(tmp_path):
    path = publish_record(tmp_path / "rendezvous" / "a.json", Point("h", 1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_record(path, Point) == Point("h", 1)
    assert read_record(tmp_path / "missing.json", Point) is None


def test_unreadable_records_are_skipped_not_fatal(tmp_path):
    folder = tmp_path / "servers"
    publish_record(folder / "1.json", Point("h", 1))
    (folder / "2.json").write_text("{half a rec")
    (folder / "3.json").write_text('{"host": "h", "other": 3}')  # not this kind of record
    publish_record(folder / "4.json", Point("g", 4))
    found = read_records(folder, Point)
    assert [(path.name, record) for path, record in found] == [
        ("1.json", Point("h", 1)),
        ("4.json", Point("g", 4)),
    ]
    assert read_records(tmp_path / "none", Point) == []
