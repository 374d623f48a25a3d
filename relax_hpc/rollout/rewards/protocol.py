"""The wire protocol of reward servers, ``relax_hpc.reward/1``: JSON over HTTP POST.

One protocol for the judge in its own component (``relax_hpc.judge.server``) and for a
user's remote reward endpoint, so that one client (``rewards.remote``) calls both.

Request: ``POST <url>`` (the judge: ``/v1/score``), ``Content-Type: application/json``::

    {"protocol": "relax_hpc.reward/1",
     "items": [{"id": "12/3", "prompt": "...", "response": "...", "reference": "...",
                "metadata": {...the row's other columns...}}]}

Response ``200``, one result per item, matched by ``id`` (order does not matter)::

    {"protocol": "relax_hpc.reward/1",
     "results": [{"id": "12/3", "score": 0.5, "details": {...}, "failed": null}]}

``failed`` (a string) says the server could not score the item; its score is then ignored.
Status codes: 401/403 (credentials) and other 4xx are not retried; 429, 5xx, a dropped
connection, a timeout and a body that does not follow this format are retried.

Credentials: an endpoint gets ``Authorization: Bearer <token>``. The judge's token never
travels: the client sends ``X-Relax-Signature: sha256=<HMAC-SHA256(token, body)>`` and the
judge checks it (the token is in the run's 0600 rendezvous file; see ``judge_address``).

Must not: do I/O; this module only encodes, decodes, signs and checks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from relax_hpc.rollout.rewards.result import RewardResult, failed
from relax_hpc.rollout.rewards.scorer import ScoreItem
from relax_hpc.signing import hmac_hex, hmac_matches

PROTOCOL = "relax_hpc.reward/1"
SCORE_PATH = "/v1/score"
HEALTH_PATH = "/v1/health"
SIGNATURE_HEADER = "X-Relax-Signature"
SIGNATURE_PREFIX = "sha256="


class ProtocolError(ValueError):
    """A body that does not follow ``relax_hpc.reward/1``; the message says what is wrong."""


def encode_request(ids: Sequence[str], items: Sequence[ScoreItem]) -> bytes:
    rows = [
        {
            "id": item_id,
            "prompt": item.prompt,
            "response": item.completion,
            "reference": item.answer,
            "metadata": dict(item.metadata),
        }
        for item_id, item in zip(ids, items, strict=True)
    ]
    # default=str: columns numpy or pyarrow left as scalars still travel, as text
    return json.dumps({"protocol": PROTOCOL, "items": rows}, default=str).encode()


def decode_request(body: bytes) -> tuple[list[str], list[ScoreItem]]:
    """The ids and items of a request (server side); ``ProtocolError`` if malformed."""
    document = _load(body, "request")
    rows = document.get("items")
    if not isinstance(rows, list):
        raise ProtocolError("the request has no list 'items'")
    ids, items = [], []
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("id"), str):
            raise ProtocolError("every item needs a string 'id'")
        if not isinstance(row.get("response"), str):
            raise ProtocolError(f"item {row['id']!r} has no string 'response'")
        metadata = row.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ProtocolError(f"item {row['id']!r}: 'metadata' must be an object")
        ids.append(row["id"])
        prompt, reference = str(row.get("prompt", "")), str(row.get("reference", ""))
        items.append(ScoreItem(row["response"], reference, metadata, prompt))
    return ids, items


def encode_response(ids: Sequence[str], results: Sequence[RewardResult]) -> bytes:
    rows = [
        {"id": item_id, "score": r.score, "details": r.details, "failed": r.failed}
        for item_id, r in zip(ids, results, strict=True)
    ]
    return json.dumps({"protocol": PROTOCOL, "results": rows}, default=str).encode()


def decode_response(body: bytes, ids: Sequence[str]) -> list[RewardResult]:
    """One result per id, in ``ids`` order; ``ProtocolError`` when the body is unusable.

    An item the server marked failed, or answered with a non-number, is a failed result
    (the rest of the batch stands); an id missing from the answer makes the whole body
    unusable (retrying may fix it).
    """
    document = _load(body, "response")
    rows = document.get("results")
    if not isinstance(rows, list):
        raise ProtocolError("the response has no list 'results'")
    by_id = {row.get("id"): row for row in rows if isinstance(row, dict)}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ProtocolError(f"the response has no result for {len(missing)} of {len(ids)} items")
    return [_result(by_id[item_id]) for item_id in ids]


def _result(row: dict[str, Any]) -> RewardResult:
    details = row.get("details") if isinstance(row.get("details"), dict) else {}
    if row.get("failed"):
        return failed(f"the server could not score it: {str(row['failed'])[:200]}", details)
    score = row.get("score")
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        return failed(f"the server answered a score that is not a finite number: {score!r}")
    return RewardResult(float(score), details)


def _load(body: bytes, what: str) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProtocolError(f"the {what} is not JSON ({err})") from None
    if not isinstance(document, dict):
        raise ProtocolError(f"the {what} is not a JSON object")
    if document.get("protocol", PROTOCOL) != PROTOCOL:
        raise ProtocolError(f"the {what} speaks {document.get('protocol')!r}, not {PROTOCOL!r}")
    return document


def sign_body(token: str, body: bytes) -> str:
    return SIGNATURE_PREFIX + hmac_hex(token, body)


def signature_valid(token: str, body: bytes, header: str | None) -> bool:
    if header is None or not header.startswith(SIGNATURE_PREFIX):
        return False
    return hmac_matches(token, body, header.removeprefix(SIGNATURE_PREFIX))
