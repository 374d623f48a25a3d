"""Prompt datasets from JSONL/Parquet files and the synthetic task."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.models.tokenizer import build_char_tokenizer

ROWS = [
    {"prompt": "What is 1+1?", "answer": "2", "source": "a"},
    {"prompt": "What is 2+3?", "answer": 5, "source": "b"},
]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    return path


def test_jsonl_with_chat_template_and_system_prompt(tmp_path):
    cfg = DataConfig(
        kind="jsonl",
        path=str(write_jsonl(tmp_path / "t.jsonl", ROWS)),
        system_prompt="Be brief.",
        apply_chat_template=True,
    )
    tokenizer = build_char_tokenizer()
    dataset = build_dataset(cfg, tokenizer)
    assert len(dataset) == 2
    record = dataset[1]
    assert record.prompt == "system: Be brief.\nuser: What is 2+3?\nassistant: "
    assert record.answer == "5"
    assert record.metadata == {"source": "b"}
    assert tokenizer.decode(record.prompt_ids) == record.prompt  # no BOS under a template


def test_parquet_with_chat_messages_and_nested_answer_key(tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": "Solve x+1=3."}],
            "reward_model": {"ground_truth": "2", "style": "rule"},
        }
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = DataConfig(kind="parquet", path=str(path), answer_key="reward_model.ground_truth")
    record = build_dataset(cfg, build_char_tokenizer())[0]
    assert record.prompt == "user: Solve x+1=3.\nassistant: "
    assert record.answer == "2"
    assert record.metadata == {}


def test_plain_prompts_without_template_get_a_bos(tmp_path):
    cfg = DataConfig(
        kind="jsonl", path=str(write_jsonl(tmp_path / "t.jsonl", ROWS)), apply_chat_template=False
    )
    tokenizer = build_char_tokenizer()
    record = build_dataset(cfg, tokenizer)[0]
    assert record.prompt == "What is 1+1?"
    assert record.prompt_ids[0] == tokenizer.bos_token_id


def test_synthetic_addition_splits():
    cfg = DataConfig(kind="synthetic_addition", digits=2, eval_size=32, apply_chat_template=False)
    tokenizer = build_char_tokenizer()
    train, held_out = build_dataset(cfg, tokenizer, "train"), build_dataset(cfg, tokenizer, "eval")
    assert (len(train), len(held_out)) == (10_000 - 32, 32)
    record = held_out[0]
    a, b = record.metadata["a"], record.metadata["b"]
    assert record.prompt == f"{a}+{b}=" and record.answer == str(a + b)[::-1]


def test_data_errors_name_the_field(tmp_path):
    tokenizer = build_char_tokenizer()
    with pytest.raises(ValueError, match="data.eval_path"):
        build_dataset(DataConfig(kind="jsonl", path="x.jsonl"), tokenizer, "eval")
    with pytest.raises(ValueError, match="does not exist"):
        build_dataset(DataConfig(kind="jsonl", path=str(tmp_path / "missing.jsonl")), tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        build_dataset(DataConfig(kind="jsonl", path=str(bad)), tokenizer)
    cfg = DataConfig(
        kind="jsonl", path=str(write_jsonl(tmp_path / "t.jsonl", ROWS)), answer_key="solution"
    )
    with pytest.raises(ValueError, match="no key 'solution'"):
        build_dataset(cfg, tokenizer)[0]
