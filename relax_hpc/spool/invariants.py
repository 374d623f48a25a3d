"""The spool's correctness property as a pure function: every published sample was
consumed exactly once by the surviving history.

The *surviving history* is the sequence of training steps that a run's final state
descends from: the steps recorded in its last checkpoint plus those it ran after it.
Steps lost to a crash (run after the checkpoint a resume started from) are not part of
it, just as their weight updates are not. Used by the crash test and by the real-Slurm
exactly-once test. Must not: read files or know how the spool stores anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

_EXAMPLES = 5


def _examples(ids: Iterable[str]) -> str:
    ids = sorted(ids)
    more = f" (+{len(ids) - _EXAMPLES} more)" if len(ids) > _EXAMPLES else ""
    return ", ".join(ids[:_EXAMPLES]) + more


def check_exactly_once(
    published_sample_ids: Iterable[str], surviving_steps: Sequence[Sequence[str]]
) -> list[str]:
    """Violations of exactly-once (empty when it holds).

    ``published_sample_ids``: every distinct sample id that was published (duplicates from
    republishing are fine and ignored). ``surviving_steps``: per surviving step, the ids of
    the samples it trained on.
    """
    published = set(published_sample_ids)
    counts = Counter(sample_id for step in surviving_steps for sample_id in step)
    violations = []
    twice = {s for s, n in counts.items() if n > 1}
    if twice:
        violations.append(f"{len(twice)} samples consumed more than once: {_examples(twice)}")
    lost = published - counts.keys()
    if lost:
        violations.append(f"{len(lost)} published samples never consumed: {_examples(lost)}")
    unknown = counts.keys() - published
    if unknown:
        violations.append(f"{len(unknown)} consumed samples never published: {_examples(unknown)}")
    return violations
