"""User-style rewards for the reward tests, in a module that imports nothing heavy.

The scorer's child process imports this module by name (its folder is on ``sys.path`` under
pytest), so it must stay cheap to import.
"""

from __future__ import annotations

import time


def raising_reward(completion, answer, metadata):
    raise RuntimeError("judge unavailable")


def hanging_reward(completion, answer, metadata):
    if completion == "hang":
        time.sleep(60)
    return len(completion)


def user_exact_match(completion, answer, metadata):
    """exact_match as a user's reward: unlike the built-in, it runs in the child process."""
    return float(completion.strip() == str(answer).strip())
