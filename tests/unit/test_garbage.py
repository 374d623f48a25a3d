"""``settle_after_startup``: startup's garbage freed, what is alive frozen, later garbage
still collected. Each case runs in a fresh interpreter: freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = """
import gc, weakref
from relax_hpc.garbage import settle_after_startup

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    return weakref.ref(a)
"""


def run_python(body: str) -> str:
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_startup_garbage_is_freed_and_the_survivors_are_frozen():
    out = run_python(
        """
        gc.disable()  # no automatic collection may free the cycle before the call
        kept = [Node() for _ in range(1000)]
        dropped = cycle()
        settle_after_startup()
        print(dropped() is None, gc.get_freeze_count() >= len(kept), gc.get_count()[2])
        """
    )
    assert out == "True True 0"


def test_a_full_collection_afterwards_skips_the_frozen_objects():
    out = run_python(
        """
        kept = [[i] for i in range(200_000)]
        settle_after_startup()
        later = cycle()
        walked = len(gc.get_objects())  # the objects a full collection walks now
        gc.collect()
        print(later() is None, walked < 1000)
        """
    )
    assert out == "True True"
