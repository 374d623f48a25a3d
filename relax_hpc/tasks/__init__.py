"""Built-in tasks: each module is the one place that knows a task's data, reward and warm start.

``base`` (the ``Task`` a module defines), ``registry`` (names -> tasks; which task a run's
policy warm-starts on), ``warm_start`` (what every warm start shares: cache, lock,
metadata, the supervised loop, progress reports), and one module per task: ``addition``,
``verifier`` (``addition_verifier``), ``scorer`` (``addition_scorer``), ``calculator``,
``guess``, ``media`` (``shapes``, ``pitch``). Adding a task: docs/architecture.md, "Plug-in recipes".

Must not: import the trainer's or the rollout's process code.
"""
