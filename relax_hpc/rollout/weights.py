"""The rollout's weight policy: join the trainer's weight sync, keep the engine's weights current.

``EngineWeights`` is fail-closed: no generation without verified weights of at least the
version the loop asks for. ``build_receiver`` picks the transport (buckets through this
process, or straight into SGLang's update group).

Must not: build engines or generate (the engine and its ``load_fn`` are handed in).
"""

from __future__ import annotations

import logging
import time

from relax_hpc.config import RunConfig
from relax_hpc.observe.metrics import LogThrottle
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.assignment import worker_name
from relax_hpc.rollout.engines.base import Engine
from relax_hpc.rollout.sglang_weights import SGLangDistributedTarget
from relax_hpc.runtime import TaskIdentity
from relax_hpc.weightsync import (
    PerTensorReceiver,
    WeightReceiver,
    WeightSyncError,
)
from relax_hpc.weightsync.receiver import LoadFn

log = logging.getLogger(__name__)
POLL_S = 0.5


class EngineWeights:
    """Keeps the engine's weights current; fail-closed: no generation without verified weights."""

    def __init__(self, receiver: WeightReceiver, engine: Engine, load: LoadFn) -> None:
        self.receiver = receiver
        self.engine = engine
        self.load = load
        self.log_lines = LogThrottle()  # "loaded policy_version": the first 10, then 1 a second

    def _behind(self, min_version: int) -> bool:
        current = self.receiver.current_policy_version
        return current is None or current < min_version

    def join(self, should_stop) -> bool:
        """Join the trainer's weight sync; retried while the trainer is (re)starting.

        A requeued job may still show the previous trainer's rendezvous file for a moment,
        and a first run's trainer may take a while to build its model.
        """
        while not should_stop():
            try:
                self.receiver.join(self.load)
            except (WeightSyncError, OSError, RuntimeError) as err:
                log.info("rollout: trainer not reachable yet (%s); retrying", err)
                time.sleep(POLL_S)
                continue
            if self.receiver.current_policy_version is not None:
                self.engine.policy_version = self.receiver.current_policy_version
            return True
        return False

    def wait_for(self, min_version: int, should_stop) -> bool:
        """Take newer weights if a round is open now; block only while behind ``min_version``.

        An async rollout that may generate with the weights it has does not wait for the
        trainer's next round: it generates while the trainer trains (the overlap), and the
        trainer's call waits for it (``weightsync.busy_timeout_s``).
        """
        while True:
            may_generate = self.receiver.ready_to_generate and not self._behind(min_version)
            # A trainer that died and restarts is waited for and rejoined by the receiver:
            # this process keeps its engine and weights (a wrong token raises).
            update = self.receiver.poll_for_update(
                self.load, wait_s=0.0 if may_generate else POLL_S
            )
            if update is None and self._behind(min_version):
                # Not admitted yet (the trainer admits at its next sync, which may need this
                # very batch): the trainer's filesystem export breaks that circle.
                update = self.receiver.load_latest_from_filesystem(self.load)
            if update is not None:
                self.engine.policy_version = update.policy_version
                if self.log_lines.due(force=update.source != "network"):  # a catch-up: always
                    log.info(
                        "rollout: loaded policy_version %d (%s)",
                        update.policy_version,
                        update.source,
                    )
            current = self.receiver.current_policy_version
            if self.receiver.ready_to_generate and current is not None and current >= min_version:
                return True
            if should_stop():
                return False


def build_receiver(
    cfg: RunConfig, paths: RunPaths, identity: TaskIdentity, engine: Engine, loaded: int | None
) -> WeightReceiver:
    """Buckets through this process (any engine), or straight into SGLang's update group."""
    engine_id = f"rollout-{identity.rank}"
    # The run's own workers wait for the trainer of their job start; an extra pool serves
    # whichever start is running (a stale endpoint refuses the connection: it retries).
    attempt = identity.attempt
    if identity.pool is not None:
        engine_id, attempt = f"rollout-{worker_name(identity.rank, identity.pool)}", ""
    if cfg.weightsync.transport == "sglang_distributed":
        return PerTensorReceiver(
            paths,
            engine_id,
            cfg.weightsync,
            SGLangDistributedTarget(engine),
            initial_policy_version=loaded,
            attempt=attempt,
        )
    return WeightReceiver(
        paths, engine_id, cfg.weightsync, initial_policy_version=loaded, attempt=attempt
    )
