"""``rollout.backend`` and ``judge.backend``: the engines, the one place that lists them.

An engine plug-in is an ``builder.EngineBuilder`` class: it builds the policy's engine (and
its tokenizer, and a media processor for a model that reads images or audio), says how the
engine takes the trainer's weights and, if it can, builds a judge's engine. Adding one: a
module with the builder and its ``Engine``, and a line here (or name it in the config as
``rollout.backend=package.module:Builder``, no line needed). Submit checks the name and, for
the job's interpreter, the libraries a built-in needs.

Must not: import torch or any engine (validation reads this on a login node).
"""

from __future__ import annotations

from relax_hpc.plugins import Plugin, Registry

ENGINES = Registry(
    "rollout.backend",
    "engine",
    {
        "transformers": Plugin(
            "relax_hpc.rollout.engines.transformers_builder:TransformersBuilder",
            ("transformers",),
        ),
        "sglang": Plugin(
            "relax_hpc.rollout.engines.sglang_builder:SGLangBuilder", ("sglang",), "gpu"
        ),
    },
)
# A judge's engine is one of the same engines (a builder with build_judge).
JUDGE_ENGINES = Registry("judge.backend", "judge engine", ENGINES.plugins)
