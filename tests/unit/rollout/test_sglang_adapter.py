"""The SGLang engine without SGLang: request building, response parsing, weight routes.

The response fixtures in tests/data/sglang/ follow the shape read from SGLang 0.5.6.post2's
source (tokenizer_manager, schedule_batch); they were not recorded on a GPU (see the README
there). A stand-in (the ``sglang_stand_in`` fixture of tests/conftest.py) replays them in
place of ``sglang.Engine`` so that the bookkeeping of
``SGLangEngine`` (policy versions, failures, drain) is checked here; the real engine is
exercised by tests/gpu/test_sglang_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relax_hpc.config.schema import JudgeConfig, ModelConfig, RunConfig
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams, sample_seed
from relax_hpc.rollout.engines.builder import engine_builder, judge_engine_builder
from relax_hpc.rollout.engines.sglang_adapter import (
    SGLangAborted,
    SGLangCallFailed,
    SGLangResponseError,
    check_logprob_environment,
    distributed_update_args,
    generate_kwargs,
    parse_completions,
    request_ids,
    require_success,
    sampling_params_for,
)
from relax_hpc.rollout.engines.sglang_engine import SGLangEngine
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine
from relax_hpc.rollout.main import build_engine
from relax_hpc.rollout.sglang_weights import SGLangWeightLoader
from relax_hpc.weightsync import fs_export, protocol

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "sglang"


def load_fixture(name: str) -> dict:
    return json.loads((DATA_DIR / name).read_text())


def fixture_call(name: str) -> tuple[dict, list[GenerationRequest], SamplingParams]:
    data = load_fixture(name)
    requests = [GenerationRequest(r["sample_id"], r["prompt_ids"]) for r in data["requests"]]
    params = SamplingParams(max_new_tokens=data["max_new_tokens"], stop=tuple(data["stop"]))
    return data, requests, params


def parse_fixture(name: str, policy_version: int = 7):
    data, requests, params = fixture_call(name)
    rids = request_ids(requests, call_index=1)
    return parse_completions(data["outputs"], requests, rids, params, policy_version)


# --- request building -------------------------------------------------------------------------
def test_sampling_params_map_onto_sglang_names():
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=12, stop=("\n\n", "###"), seed=3
    )
    got = sampling_params_for(params, GenerationRequest("g4/2", [1, 2]), seeded=True)
    assert got == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # SGLang reads -1 as the whole vocabulary, like us
        "max_new_tokens": 12,
        "stop": ["\n\n", "###"],
        "no_stop_trim": True,
        "skip_special_tokens": True,
        "sampling_seed": sample_seed(3, "g4/2") & 0x7FFF_FFFF,
    }


def test_seeds_fit_sglangs_int32_seed_tensor():
    """Deterministic SGLang packs seeds with torch.int32: a 63-bit seed would crash it."""
    params = SamplingParams(seed=2**40 + 5)
    requests = [GenerationRequest(f"g{i}/0", [1]) for i in range(200)]
    kwargs = generate_kwargs(requests, params, request_ids(requests, 1), seeded=True)
    seeds = [p["sampling_seed"] for p in kwargs["sampling_params"]]
    torch.tensor(seeds, dtype=torch.int32)  # raises on overflow
    assert len(set(seeds)) == len(seeds)


def test_greedy_is_temperature_zero_and_ignores_sampling_knobs():
    params = SamplingParams(temperature=0.7, top_p=0.5, top_k=5, greedy=True, max_new_tokens=3)
    got = sampling_params_for(params, GenerationRequest("eval/0", [1]), seeded=False)
    assert (got["temperature"], got["top_p"], got["top_k"]) == (0.0, 1.0, 1)
    assert "stop" not in got and "sampling_seed" not in got


def test_every_sample_gets_its_own_seed_and_unseeded_sglang_gets_none():
    params = SamplingParams(seed=11)
    requests = [GenerationRequest("g0/0", [1]), GenerationRequest("g0/1", [1])]
    kwargs = generate_kwargs(requests, params, request_ids(requests, 1), seeded=True)
    seeds = [p["sampling_seed"] for p in kwargs["sampling_params"]]
    assert seeds == [sample_seed(11, "g0/0") & 0x7FFF_FFFF, sample_seed(11, "g0/1") & 0x7FFF_FFFF]
    assert seeds[0] != seeds[1]
    unseeded = generate_kwargs(requests, params, request_ids(requests, 1), seeded=False)
    assert all("sampling_seed" not in p for p in unseeded["sampling_params"])


def test_batch_kwargs_carry_token_ids_rids_and_logprobs():
    requests = [GenerationRequest("g0/0", [5, 6, 7]), GenerationRequest("g1/0", [8])]
    kwargs = generate_kwargs(requests, SamplingParams(), request_ids(requests, 3), seeded=False)
    assert kwargs["input_ids"] == [[5, 6, 7], [8]]
    assert kwargs["rid"] == ["g0/0@3", "g1/0@3"]
    assert kwargs["return_logprob"] is True
    assert "image_data" not in kwargs and "audio_data" not in kwargs
    with pytest.raises(ValueError, match="at least one prompt token"):
        generate_kwargs([GenerationRequest("g2/0", [])], SamplingParams(), ["x"], seeded=False)


def test_multimodal_inputs_pass_through_aligned_with_the_batch():
    image = {"format": "processor_output", "pixel_values": [[0.5]]}
    requests = [
        GenerationRequest("g0/0", [1], multimodal={"image": ["cat.png", image]}),
        GenerationRequest("g1/0", [2]),
        GenerationRequest("g2/0", [3], multimodal={"audio": "clip.wav"}),
    ]
    kwargs = generate_kwargs(requests, SamplingParams(), request_ids(requests, 1), seeded=False)
    assert kwargs["image_data"] == [["cat.png", image], None, None]
    assert kwargs["audio_data"] == [None, None, ["clip.wav"]]  # always a list per request
    video = [GenerationRequest("g3/0", [1], multimodal={"video": "v.mp4"})]
    with pytest.raises(ValueError, match="video"):
        generate_kwargs(video, SamplingParams(), ["r"], seeded=False)


# --- response parsing ------------------------------------------------------------------------
def test_finish_reasons_eos_stop_string_and_length():
    eos, stop_string, length = parse_fixture("batch_eos_stop_length.json")
    assert (eos.finish_reason, eos.stop) == ("stop", None)
    assert eos.token_ids[-1] == load_fixture("batch_eos_stop_length.json")["eos_token_id"]
    assert (stop_string.finish_reason, stop_string.stop) == ("stop", "\n\n")
    assert stop_string.text.endswith("\n\n")  # no_stop_trim: the text is every token's text
    assert (length.finish_reason, length.stop) == ("length", None)
    assert len(length.token_ids) == 4


def test_a_stop_on_a_string_that_is_not_ours_is_an_error():
    """SGLang reports NaN logits as a stop on the string "NaN happened" (and writes EOS)."""
    data, requests, params = fixture_call("batch_eos_stop_length.json")
    data["outputs"][0]["meta_info"]["finish_reason"] = {"type": "stop", "matched": "NaN happened"}
    with pytest.raises(SGLangResponseError, match="NaN happened"):
        parse_completions(data["outputs"], requests, request_ids(requests, 1), params, 0)


def test_token_ids_and_logprobs_come_from_output_token_logprobs():
    eos, stop_string, length = parse_fixture("batch_eos_stop_length.json", policy_version=7)
    assert eos.token_ids == [38835, 34208, 151645]
    assert eos.logprobs == pytest.approx([-0.6931471824645996, -1.203972887992859, -0.1053605452])
    assert stop_string.token_ids == [5562, 271]
    assert stop_string.logprobs == pytest.approx([-2.3025851249694824, -0.3566749394])
    assert length.logprobs == pytest.approx(
        [-0.0161297329, -3.912023067, -0.5108255744, -0.0010005]
    )
    assert [c.sample_id for c in (eos, stop_string, length)] == ["g0/0", "g0/1", "g1/0"]
    assert eos.prompt_ids == [785, 3974, 13876] and length.prompt_ids == [18, 10, 19, 28]
    assert {c.policy_version for c in (eos, stop_string, length)} == {7}


def test_results_out_of_request_order_are_refused():
    data, requests, params = fixture_call("batch_eos_stop_length.json")
    rids = request_ids(requests, 1)
    with pytest.raises(SGLangResponseError, match="batch order"):
        parse_completions(data["outputs"][::-1], requests, rids, params, 0)
    with pytest.raises(SGLangResponseError, match="2 results for 3 requests"):
        parse_completions(data["outputs"][:2], requests, rids, params, 0)


def test_missing_logprobs_is_a_clear_error():
    with pytest.raises(SGLangResponseError, match="no output_token_logprobs.*return_logprob"):
        parse_fixture("missing_logprobs.json")


def test_truncated_logprobs_are_refused():
    data, requests, params = fixture_call("batch_eos_stop_length.json")
    data["outputs"][0]["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(SGLangResponseError, match="2 log-probs for 3 generated tokens"):
        parse_completions(data["outputs"], requests, request_ids(requests, 1), params, 0)


def test_an_aborted_request_raises_instead_of_returning_a_partial_completion():
    with pytest.raises(SGLangAborted, match="Abort before prefill"):
        parse_fixture("aborted.json")


# --- control results, manifests, environment ---------------------------------------------------
def test_require_success_reads_the_result_shapes_of_sglang():
    assert require_success((True, "Succeeded to update model weights.", 0), "x").startswith("Succ")
    assert require_success(None, "release") == ""
    with pytest.raises(SGLangCallFailed, match="update_weights_from_disk failed: no such file"):
        require_success((False, "no such file", 0), "update_weights_from_disk")
    with pytest.raises(SGLangCallFailed, match="shape mismatch"):
        require_success({"success": False, "message": "shape mismatch"}, "update")


def test_distributed_update_args_follow_the_manifest_order():
    tensors = [("embed.weight", torch.zeros(4, 3)), ("norm.weight", torch.zeros(3))]
    layout = protocol.plan_layout(tensors, bucket_nbytes=1 << 20, serve_dtype=torch.bfloat16)
    assert distributed_update_args(layout.tensors) == {
        "names": ["embed.weight", "norm.weight"],
        "dtypes": ["bfloat16", "bfloat16"],
        "shapes": [[4, 3], [3]],
    }


def test_original_logprob_mode_of_sglang_is_refused():
    check_logprob_environment({})
    check_logprob_environment({"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"})
    with pytest.raises(ValueError, match="unset it"):
        check_logprob_environment({"SGLANG_RETURN_ORIGINAL_LOGPROB": "True"})


# --- SGLangEngine bookkeeping with a stand-in for sglang.Engine ---------------------------------
def test_engine_launches_one_sglang_engine_per_tp_group_and_parses_its_batch(sglang_stand_in):
    data, requests, params = fixture_call("batch_eos_stop_length.json")
    engine, sglang = sglang_stand_in(data["outputs"])
    assert sglang.server_args["tp_size"] == 2
    assert sglang.server_args["mem_fraction_static"] == 0.7
    completions = engine.generate(requests, params)
    name, kwargs = sglang.calls[0]
    assert name == "generate" and kwargs["rid"] == ["g0/0@1", "g0/1@1", "g1/0@1"]
    assert [c.finish_reason for c in completions] == ["stop", "stop", "length"]
    assert {c.policy_version for c in completions} == {0}


def test_policy_version_changes_only_after_sglang_reports_success(tmp_path, sglang_stand_in):
    engine, sglang = sglang_stand_in()
    sglang.results["update_weights_from_tensor"] = (False, "shape mismatch")
    with pytest.raises(SGLangCallFailed, match="shape mismatch"):
        engine.load_state_dict({"w": torch.ones(2)}, policy_version=3)
    assert engine.policy_version == 0
    sglang.results["update_weights_from_tensor"] = (True, "ok")
    engine.load_state_dict({"w": torch.ones(2)}, policy_version=3)
    assert engine.policy_version == 3
    assert sglang.calls[-1][1]["flush_cache"] is True
    engine.update_weights_from_disk(tmp_path, policy_version=4)
    assert sglang.calls[-1] == ("update_weights_from_disk", {"model_path": str(tmp_path)})
    assert engine.policy_version == 4


def test_weight_updates_go_in_chunks_and_flush_the_cache_once(monkeypatch, sglang_stand_in):
    """SGLang allocates every tensor of a call on the GPU first: a whole model at once can
    exhaust what the KV cache left. 1 KiB chunks over 5 x 400-byte tensors -> 3 calls."""
    from relax_hpc.rollout.engines import sglang_engine
    from relax_hpc.weightsync.protocol import TensorSpec

    monkeypatch.setattr(sglang_engine, "UPDATE_CHUNK_BYTES", 1024)
    engine, sglang = sglang_stand_in()
    tensors = {f"w{i}": torch.ones(100) for i in range(5)}  # float32: 400 bytes each
    engine.load_state_dict(tensors, policy_version=1)
    calls = [kw for name, kw in sglang.calls if name == "update_weights_from_tensor"]
    assert [[n for n, _ in kw["named_tensors"]] for kw in calls] == [
        ["w0", "w1"],
        ["w2", "w3"],
        ["w4"],
    ]
    assert [kw["flush_cache"] for kw in calls] == [False, False, True]
    specs = [TensorSpec(f"w{i}", "bfloat16", (300,), 0, 0) for i in range(4)]  # 600 bytes
    engine.update_weights_from_distributed(specs, policy_version=2)
    calls = [kw for name, kw in sglang.calls if name == "update_weights_from_distributed"]
    assert [kw["names"] for kw in calls] == [["w0"], ["w1"], ["w2"], ["w3"]]
    assert [kw["flush_cache"] for kw in calls] == [False, False, False, True]
    assert engine.policy_version == 2


def test_layouts_with_more_ranks_than_one_tp_group_are_refused(sglang_stand_in):
    with pytest.raises(ValueError, match="dp_size"):
        sglang_stand_in(extra_server_args={"dp_size": 2})


def test_memory_saver_keeps_a_cpu_copy_of_the_weights(sglang_stand_in):
    _, sglang = sglang_stand_in(memory_saver=True)
    assert sglang.server_args["enable_weights_cpu_backup"] is True


def test_colocation_releases_everything_and_takes_back_weights_then_the_rest(sglang_stand_in):
    """mode=sync: released after a batch; a weight update resumes the weights only (SGLang
    cannot write into released memory), the next generate resumes the KV cache too."""
    data, requests, params = fixture_call("batch_eos_stop_length.json")
    engine, sglang = sglang_stand_in(data["outputs"], memory_saver=True)

    def memory_calls():
        """The calls since the last look, memory calls with their tags."""
        calls = [(n, kw["tags"]) if "memory" in n else n for n, kw in sglang.calls]
        sglang.calls.clear()
        return calls

    engine.release_memory()
    engine.release_memory()  # idempotent
    assert memory_calls() == [
        ("release_memory_occupation", ["kv_cache", "weights", "cuda_graph"])
    ]
    engine.load_state_dict({"w": torch.ones(2)}, policy_version=1)
    assert memory_calls() == [
        ("resume_memory_occupation", ["weights"]),
        "update_weights_from_tensor",
    ]
    engine.generate(requests, params)
    assert memory_calls() == [("resume_memory_occupation", ["kv_cache", "cuda_graph"]), "generate"]
    engine.resume_memory()
    assert memory_calls() == []  # nothing left to resume


def test_drain_aborts_every_in_flight_request_and_memory_calls_need_the_saver(sglang_stand_in):
    engine, sglang = sglang_stand_in()
    engine.abort_in_flight()
    assert sglang.tokenizer_manager.aborted == [True]
    with pytest.raises(ValueError, match="memory_saver=True"):
        engine.release_memory()
    engine.pause_generation()
    engine.continue_generation()
    assert sglang.tokenizer_manager.paused == [True, False]


def test_loader_starts_sglang_from_the_verified_export_on_disk(tmp_path, sglang_stand_in):
    paths = RunPaths(tmp_path).create()
    engine, sglang = sglang_stand_in()
    loader = SGLangWeightLoader(engine)
    assert loader.load_latest_published(paths) is None  # nothing published yet
    fs_export.publish_weights(paths, {"w": torch.arange(4.0)}, policy_version=5)
    assert loader.load_latest_published(paths) == 5
    disk_call = ("update_weights_from_disk", {"model_path": str(paths.weights_version_dir(5))})
    assert sglang.calls[-1] == disk_call
    assert engine.policy_version == 5
    loader({"w": torch.zeros(4)})  # the receiver's load_fn: tensors go to SGLang
    assert sglang.calls[-1][0] == "update_weights_from_tensor"
    assert engine.policy_version == 5  # the rollout stamps it after the receiver verified


def test_loader_refuses_a_corrupt_export(tmp_path, sglang_stand_in):
    paths = RunPaths(tmp_path).create()
    fs_export.publish_weights(paths, {"w": torch.arange(4.0)}, policy_version=2)
    weights_file = paths.weights_version_dir(2) / fs_export.WEIGHTS_FILE
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 0xFF
    weights_file.write_bytes(bytes(data))
    engine, sglang = sglang_stand_in()
    assert SGLangWeightLoader(engine).load_latest_published(paths) is None
    assert not any(name == "update_weights_from_disk" for name, _ in sglang.calls)
    assert engine.policy_version == 0


# --- engine builders (rollout/engines/*_builder.py) -------------------------------------------------------------------
TINY_ARCH = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def test_build_engine_picks_sglang_from_rollout_backend(monkeypatch, tmp_path):
    from relax_hpc.rollout.engines import sglang_engine

    launched: list[dict] = []
    monkeypatch.setattr(sglang_engine, "_launch_sglang", lambda **a: launched.append(a) or a)
    monkeypatch.setattr(sglang_engine, "_sampling_seed_supported", lambda: True)
    cfg = RunConfig(model=ModelConfig(name="q", path=str(tmp_path), tokenizer="char"))
    cfg.rollout.backend = "sglang"
    cfg.rollout.engine_tensor_parallel = 4
    engine, *_ = build_engine(cfg, torch.device("cpu"))
    assert isinstance(engine, SGLangEngine)
    assert launched[0]["model_path"] == str(tmp_path) and launched[0]["tp_size"] == 4
    assert launched[0]["mem_fraction_static"] == cfg.rollout.engine_mem_fraction
    assert launched[0]["dtype"] == "bfloat16"  # model.dtype auto on a GPU
    assert launched[0]["enable_memory_saver"] is False  # async: the engine keeps its GPUs
    assert (launched[0]["port"], launched[0]["nccl_port"]) == (30000, 30001)  # engine 0's
    cfg.mode = "sync"  # time-shares the trainer's GPUs: releases its memory between batches
    build_engine(cfg, torch.device("cpu"))
    assert launched[1]["enable_memory_saver"] and launched[1]["enable_weights_cpu_backup"]
    cfg.model.path = None
    with pytest.raises(ValueError, match="needs model.path"):
        build_engine(cfg, torch.device("cpu"))


def test_transformers_backend_keeps_copying_received_tensors_into_the_model(tmp_path):
    cfg = RunConfig(model=ModelConfig(name="t", tokenizer="char", arch=TINY_ARCH))
    engine, *_ = build_engine(cfg, torch.device("cpu"))
    assert isinstance(engine, TransformersEngine)
    loader = engine_builder(cfg.rollout.backend).weight_loader
    load, loaded_version = loader(engine, RunPaths(tmp_path).create())
    assert loaded_version is None  # every version comes through the receiver
    norm = torch.full_like(engine.model.state_dict()["model.norm.weight"], 0.5)
    load({"model.norm.weight": norm})
    assert torch.equal(engine.model.state_dict()["model.norm.weight"], norm)


def test_an_sglang_judge_serves_on_its_engines_gpus_eight_ports_above(monkeypatch, tmp_path):
    from relax_hpc.rollout.engines import sglang_engine

    launched: list[dict] = []
    monkeypatch.setattr(sglang_engine, "_launch_sglang", lambda **a: launched.append(a) or a)
    monkeypatch.setattr(sglang_engine, "_sampling_seed_supported", lambda: True)
    model = ModelConfig(name="j", path=str(tmp_path), tokenizer="char")
    judge = JudgeConfig(model=model, backend="sglang", engine_tensor_parallel=2)
    builder = judge_engine_builder(judge.backend)
    engine, max_positions = builder.build_judge(judge, model, None, torch.device("cuda", 2), 0)
    assert isinstance(engine, SGLangEngine) and max_positions is None  # SGLang refuses itself
    assert launched[0]["base_gpu_id"] == 2 and launched[0]["tp_size"] == 2
    assert (launched[0]["port"], launched[0]["nccl_port"]) == (30040, 30041)  # 30000+16*2+8
    assert launched[0]["mem_fraction_static"] == judge.engine_mem_fraction
