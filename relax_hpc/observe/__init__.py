"""Observability: TensorBoard scalars, phase timers, progress lines, heartbeats.

Each role writes its own TensorBoard run under ``RunPaths.tensorboard_dir`` (``trainer``,
``rollout-<rank>``), so one ``tensorboard --logdir <run dir>/tensorboard`` shows both.
"""
