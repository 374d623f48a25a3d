"""A sample's reward from weighted parts (rule rewards, the judge, reward models, endpoints).

``CompositeScorer`` scores each part on the samples whose weight table names it (a part of
weight 0 is scored and logged, not added), adds ``weight x score``, and keeps every part's
score and details in the sample's ``reward_details``::

    {"parts": {"dapo_math": 1.0, "judge": 0.0}, "dapo_math": {...}, "judge": {...},
     "failed_parts": {"judge": "gave up after 4 attempts ..."}}

The weight table of a sample is ``weights_by_source[metadata[source_key]]`` when its row
names a source that has one, else the default table. A sample is *failed* (reward details
``failed``) when a part with a non-zero weight failed; that part adds 0.

With a single part and no monitors the part's own result passes through unchanged (the
reward details of a plain ``rollout.reward=exact_match`` run stay what they were).

``metrics()`` gives what the rollout logs per batch: ``rewards/<part>/mean`` (over scored,
unfailed samples), ``rewards/<part>/failed``, ``rewards/failed`` (samples), and
``rewards/agreement/<part>``: how often a part's verdict (score > 0.5) agrees with
the ``agreement_with`` part's; and running totals since the start:
``rewards/<part>/samples_total`` and ``failed_total`` for every part, plus each service's
own (``requests_total``, ``retries_total``, ``wait_s_total``, ``circuit_opened_total``).

Must not: import torch or know how a part computes its score.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_hpc.rollout.rewards.result import BatchScorer, RewardResult, failed
from relax_hpc.rollout.rewards.scorer import as_score_item

CORRECT_ABOVE = 0.5  # the threshold of reward/accuracy and held-out accuracy


@dataclass(frozen=True)
class Weights:
    default: dict[str, float]
    by_source: dict[str, dict[str, float]] = field(default_factory=dict)
    source_key: str | None = None

    def table(self, metadata: Mapping[str, Any]) -> dict[str, float] | str:
        """The sample's weight table, or why it has none."""
        source = metadata.get(self.source_key) if self.source_key else None
        if source is not None and str(source) in self.by_source:
            return self.by_source[str(source)]
        if self.default:
            return self.default
        return (
            f"data source {source!r} (column {self.source_key!r}) has no entry in "
            "rewards.weights_by_source and rewards.weights is empty"
        )


class CompositeScorer:
    def __init__(
        self,
        parts: Mapping[str, BatchScorer],
        weights: Weights,
        agreement_with: str | None = None,
    ) -> None:
        self.parts = dict(parts)
        self.weights = weights
        self.agreement_with = agreement_with
        self._batch: dict[str, float] = {}
        self._totals: dict[str, float] = {}  # samples and failures per part, since the start
        sole = list(weights.default) if not weights.by_source else []
        self.passthrough = (
            len(sole) == 1 and weights.default[sole[0]] == 1.0 and agreement_with in (None, sole[0])
        )

    def score(self, items: Sequence[Any]) -> list[RewardResult]:
        items = [as_score_item(item) for item in items]
        tables = [self.weights.table(item.metadata) for item in items]
        by_part = self._score_parts(items, tables)
        if self.passthrough:
            (results,) = by_part.values()
            final = [results[i] for i in range(len(items))]
        else:
            final = [self._combine(i, table, by_part) for i, table in enumerate(tables)]
        self._record(by_part, final)
        return final

    def metrics(self) -> dict[str, float]:
        """The last batch's per-part figures and each service's running totals."""
        out = {**self._batch, **self._totals}
        for name, part in self.parts.items():
            totals = getattr(part, "metrics", None)
            if callable(totals):
                out.update({f"rewards/{name}/{key}": value for key, value in totals().items()})
        return out

    def close(self) -> None:
        for part in self.parts.values():
            part.close()

    def _score_parts(
        self, items: list, tables: list[dict[str, float] | str]
    ) -> dict[str, dict[int, RewardResult]]:
        by_part: dict[str, dict[int, RewardResult]] = {}
        for name, part in self.parts.items():
            wanted = [
                i
                for i, table in enumerate(tables)
                if isinstance(table, dict) and (name in table or name == self.agreement_with)
            ]
            if wanted:
                results = part.score([items[i] for i in wanted])
                by_part[name] = dict(zip(wanted, results, strict=True))
        return by_part

    def _combine(
        self, index: int, table: dict[str, float] | str, by_part: dict[str, dict[int, RewardResult]]
    ) -> RewardResult:
        if isinstance(table, str):
            return failed(table)
        details: dict[str, Any] = {"parts": {}}
        failures: dict[str, str] = {}
        total = 0.0
        for name, results in by_part.items():
            if index not in results:
                continue
            result = results[index]
            details["parts"][name] = result.score
            details[name] = result.details
            if result.failed:
                failures[name] = result.failed
            total += table.get(name, 0.0) * (0.0 if result.failed else result.score)
        if failures:
            details["failed_parts"] = failures
        counted = {name: reason for name, reason in failures.items() if table.get(name, 0.0)}
        reason = "; ".join(f"{name}: {why}" for name, why in counted.items()) or None
        return RewardResult(total, details, failed=reason)

    def _record(
        self, by_part: dict[str, dict[int, RewardResult]], final: list[RewardResult]
    ) -> None:
        batch: dict[str, float] = {
            "rewards/failed": float(sum(r.failed is not None for r in final))
        }
        for name, results in by_part.items():
            good = [r.score for r in results.values() if not r.failed]
            batch[f"rewards/{name}/failed"] = float(len(results) - len(good))
            for key, count in (("samples", len(results)), ("failed", len(results) - len(good))):
                total = f"rewards/{name}/{key}_total"
                self._totals[total] = self._totals.get(total, 0.0) + count
            if good:
                batch[f"rewards/{name}/mean"] = sum(good) / len(good)
        batch.update(self._agreement(by_part))
        self._batch = batch

    def _agreement(self, by_part: dict[str, dict[int, RewardResult]]) -> dict[str, float]:
        reference = by_part.get(self.agreement_with or "", {})
        out = {}
        for name, results in by_part.items():
            if name == self.agreement_with:
                continue
            both = [
                (r.score > CORRECT_ABOVE) == (reference[i].score > CORRECT_ABOVE)
                for i, r in results.items()
                if i in reference and not r.failed and not reference[i].failed
            ]
            if both:
                out[f"rewards/agreement/{name}"] = sum(both) / len(both)
        return out
