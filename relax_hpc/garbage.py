"""The cyclic garbage collector in a long-running role: set once, before its loop.

A full collection walks every object Python tracks. After torch, transformers and the model
are loaded that is ~400k objects, 0.15-0.3 s of one core each time; Python starts one
whenever enough objects have outlived younger collections, which a loop that keeps a
little of every step (metrics, history) reached every 200-300 steps of grpo_tiny: a stall
that the other role then waits out (docs/performance.md section 13).

``settle_after_startup`` collects once, then freezes what is alive (``gc.freeze``): later
collections skip those objects. They are the modules, the model and the role's parts,
alive to the end; one of them that later becomes part of an unreachable cycle is not
freed, a leak bounded by what existed at startup. Objects made afterwards are collected
as before.
"""

from __future__ import annotations

import gc


def settle_after_startup() -> None:
    """Free startup's garbage, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()
