"""A rollout worker generates a stale group again before new chunks (rollout/loop.py with
spool/redo.py): with weights at least as new as the trainer's at the drop, under the redo's
own sample ids, and marks it done; the real tiny model, spool writer and claims, the
weight receiver played by a stand-in (it needs a trainer process, tested in tests/dist)."""

from __future__ import annotations

from tiny_models import tiny_qwen3, tiny_qwen3_arch

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.data.sampler import PromptSampler
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.rollout.assignment import GroupAssignment
from relax_hpc.rollout.engines.base import SamplingParams
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine
from relax_hpc.rollout.loop import RolloutSettings, RolloutWorker
from relax_hpc.spool import ShardWriter, read_shard
from relax_hpc.spool.layout import SpoolLayout, list_names
from relax_hpc.spool.redo import RedoRequest, open_requests, request_redo


class Weights:
    """The trainer's side: any version asked for is there (its weights are not the subject)."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine
        self.asked: list[int] = []

    def wait_for(self, min_version: int, should_stop) -> bool:
        self.asked.append(min_version)
        self.engine.policy_version = max(self.engine.policy_version, min_version)
        return True


def test_a_redo_is_generated_first_with_fresh_weights_and_its_own_ids(tmp_path):
    model, tokenizer = tiny_qwen3(tiny_qwen3_arch(num_hidden_layers=1))
    engine = TransformersEngine(model, tokenizer)
    spool = SpoolLayout(tmp_path / "spool")
    request_redo(spool.redo_dir, RedoRequest(group=3, attempt=1, min_policy_version=5))
    weights = Weights(engine)
    worker = RolloutWorker(
        settings=RolloutSettings(
            prompts_per_step=2,
            n_samples_per_prompt=2,
            max_staleness=0,
            eval_interval_steps=0,
            seed=1,
        ),
        engine=engine,
        sampler=PromptSampler(build_dataset(DataConfig(), tokenizer), seed=1),
        score=lambda pairs: [(0.0, {}) for _ in pairs],
        writer=ShardWriter(spool.spool_dir, "w0"),
        weights=weights,
        params=SamplingParams(temperature=1.0, max_new_tokens=4, seed=3),
        metrics=MetricsLogger(None, None),
        assignment=GroupAssignment(
            tmp_path / "assign", "r0", 2, 2, lease_s=60, redo_dir=spool.redo_dir
        ),
        should_stop=lambda: len(list_names(spool.ready_dir)) >= 2,
    )
    assert worker.run() == 0
    first, second = (read_shard(spool.ready_dir / n)[1] for n in list_names(spool.ready_dir))
    [redo] = first
    assert [s.sample_id for s in redo] == ["3/0.r1", "3/1.r1"] and redo[0].group_id == "3"
    assert {s.policy_version for s in redo} == {5}  # the trainer's version at the drop
    assert weights.asked[0] == 5
    assert [s.sample_id for g in second for s in g] == ["0/0", "0/1", "1/0", "1/1"]
    assert redo[0].data_index == worker._prompt(3)[0]  # the dropped group's own prompt
    assert open_requests(spool.redo_dir) == []  # done
