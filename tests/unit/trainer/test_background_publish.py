"""``weightsync.background_send``: the trainer trains step N+1 while version N is still being
sent, and what is sent is version N whole.

The real trainer loop, spool and torch backend, wired as ``trainer/main.py`` wires them; only
the transport is a stand-in (the real one: tests/dist/test_weightsync*.py), one that does not
finish sending version N before the trainer has trained step N+1. A trainer that sends
between two steps never gets there: that send gives up after its bound and the test fails.
Nothing here depends on how fast the machine is: the sends wait on the trainer's state.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from loop_fixtures import loop_settings
from test_failed_rewards import GROUPS_PER_STEP, PER_GROUP, STEPS, make_backend_of, scored_groups

from relax_hpc import exitcodes
from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.checkpoint.store import CheckpointStore
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import RunPaths
from relax_hpc.spool import ShardWriter, SpoolReader
from relax_hpc.trainer.loop import Trainer, sequential_broadcast
from relax_hpc.trainer.publish import BackgroundPublisher

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
BOUND_S = 60.0  # generous: a send that waits this long means the trainer never went on


class SlowTransport:
    """Sends version N only once the trainer has trained step N+1 (or after ``BOUND_S``)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.sent: list[int] = []
        self.overlapped: list[int] = []  # versions still in flight while the next step trained
        self.received: dict[int, dict[str, torch.Tensor]] = {}

    def sync(self, weights, policy_version: int, only) -> dict[str, float]:
        deadline = time.monotonic() + BOUND_S
        if policy_version < STEPS:  # the last version has no next step to wait for
            while self.trainer.progress.step <= policy_version:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            else:
                self.overlapped.append(policy_version)
        self.sent.append(policy_version)
        self.received[policy_version] = {k: t.clone() for k, t in weights.items()}
        return {"weightsync/engines": 1.0}


def test_the_trainer_trains_on_while_a_version_is_sent_and_sends_each_whole(tmp_path):
    paths = RunPaths(tmp_path).create()
    ShardWriter(paths.spool_dir, "w0", shard_max_samples=PER_GROUP).publish(scored_groups())
    backend = make_backend_of(AlgoConfig(name="grpo"))
    transport = SlowTransport()
    publisher = BackgroundPublisher(transport.sync)
    published: dict[int, dict[str, torch.Tensor]] = {}

    def publish_weights(policy_version: int) -> dict[str, float]:  # as trainer/main.py does
        weights = backend.policy_weights()
        published[policy_version] = {k: t.detach().clone() for k, t in weights.items()}
        return publisher.publish(weights, policy_version)

    settings = loop_settings(STEPS, GROUPS_PER_STEP, STEPS)
    trainer = Trainer(
        settings=settings,
        spec=resolve(AlgoConfig(name="grpo")),
        backend=backend,
        reader=SpoolReader(paths.spool_dir),
        publish_weights=publish_weights,
        store=CheckpointStore(paths, keep=1),
        stop=StopFlag(),
        metrics=MetricsLogger(None, None),
        broadcast_groups=sequential_broadcast,
    )
    transport.trainer = trainer
    publish_weights(0)
    assert trainer.run() == exitcodes.DONE
    publisher.wait()

    assert transport.sent == list(range(STEPS + 1))  # every version, once, in order
    assert transport.overlapped == list(range(STEPS))  # each sent while the next step trained
    for version, weights in transport.received.items():  # each as it was after its step
        assert weights.keys() == published[version].keys()
        assert all(torch.equal(weights[k], published[version][k]) for k in weights)
    live = backend.policy_weights()
    assert not all(torch.equal(transport.received[0][k], live[k]) for k in live)


def test_a_failed_send_is_raised_by_the_next_publish_and_by_wait():
    calls: list[int] = []
    started = threading.Event()

    def failing_sync(weights, policy_version, only):
        calls.append(policy_version)
        started.set()
        raise RuntimeError(f"version {policy_version}: the store is gone")

    publisher = BackgroundPublisher(failing_sync)
    weights = {"w": torch.ones(2)}
    assert publisher.publish(weights, 1) == {"weightsync/wait_previous_s": pytest.approx(0, abs=60)}
    assert started.wait(60)
    with pytest.raises(RuntimeError, match="version 1"):
        publisher.publish(weights, 2)  # the trainer stops there: version 2 is not sent
    assert publisher.wait() == {}  # raised once; nothing in flight
    publisher.publish(weights, 3)
    with pytest.raises(RuntimeError, match="version 3"):
        publisher.wait()
    assert calls == [1, 3]


def test_every_version_is_sent_by_one_long_lived_thread_in_order():
    """One sender thread for the whole run (a thread started per step cost the loop the wait
    for it to be scheduled), each version's snapshot taken before the next step."""
    sent: list[tuple[int, str, float]] = []

    def sync(weights, policy_version, only):
        sent.append((policy_version, threading.current_thread(), float(weights["w"][0])))
        return {"weightsync/seconds": 0.0}

    publisher = BackgroundPublisher(sync)
    live = torch.zeros(1)
    for version in range(1, 6):
        live += 1  # the optimiser step changes the live weights in place
        publisher.publish({"w": live}, version)
    publisher.close()
    assert [(v, value) for v, _, value in sent] == [(v, float(v)) for v in range(1, 6)]
    (sender,) = {thread for _, thread, _ in sent}
    assert sender.name == "weightsync-send" and not sender.is_alive()  # close ended it


@pytest.mark.parametrize(
    ("overrides", "in_background"),
    [
        ([], True),  # grpo_tiny: async, background_send on
        (["weightsync.background_send=false"], False),
        (["mode=sync", "max_staleness=0"], False),
        (["mode=hybrid", "max_staleness=0"], False),
    ],
    ids=["grpo_tiny", "off", "sync", "hybrid"],
)
def test_only_async_runs_send_in_the_background(overrides, in_background, caplog):
    """grpo_tiny turns background_send on; sync and hybrid runs of it are accepted (they wait
    for each version anyway) and publish between steps, saying so once."""
    from relax_hpc.config import validate_run_config
    from relax_hpc.config.compose import compose_run_config
    from relax_hpc.trainer.main import background_publisher

    caplog.set_level("INFO", logger="relax_hpc.trainer.main")
    cfg = compose_run_config(["+experiment=grpo_tiny", *overrides])
    validate_run_config(cfg)
    publisher = background_publisher(cfg, lambda *args: {})
    assert isinstance(publisher, BackgroundPublisher) is in_background
    said = "background_send has no effect in mode=" in caplog.text
    assert said is (cfg.weightsync.background_send and not in_background)
    assert publisher is None or publisher.wait() == {}  # nothing in flight yet


@pytest.mark.parametrize(
    ("overrides", "from_process"),
    [
        ([], True),  # grpo_tiny: async, background_send, buckets over Gloo
        (["weightsync.send_process=false"], False),
        (["weightsync.background_send=false"], False),
        (["mode=sync", "max_staleness=0"], False),
    ],
    ids=["grpo_tiny", "thread", "no-background", "sync"],
)
def test_a_background_send_over_gloo_runs_in_a_child_process(overrides, from_process):
    from relax_hpc.config import validate_run_config
    from relax_hpc.config.compose import compose_run_config
    from relax_hpc.trainer.main import sends_from_process

    cfg = compose_run_config(["+experiment=grpo_tiny", *overrides])
    validate_run_config(cfg)
    assert sends_from_process(cfg, "gloo") is from_process
    assert not sends_from_process(cfg, "nccl")  # device tensors: the thread



def test_without_memfd_the_thread_sends(monkeypatch):
    """A laptop's macOS has no ``os.memfd_create``: grpo_tiny there sends from the thread."""
    from relax_hpc.config import validate_run_config
    from relax_hpc.config.compose import compose_run_config
    from relax_hpc.trainer.main import sends_from_process

    cfg = compose_run_config(["+experiment=grpo_tiny"])
    validate_run_config(cfg)
    monkeypatch.delattr("os.memfd_create")
    assert not sends_from_process(cfg, "gloo")
