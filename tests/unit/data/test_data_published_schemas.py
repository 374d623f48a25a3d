"""Each shipped data config reads its dataset as it is published.

The fixtures are written here by hand, in the published layout (DAPO-Math-17k's nested
Parquet columns, Geometry3K's Hugging Face ``Image`` list, slime's JSONL), independent of
``relax_hpc.data.schemas``; the schemas' own example rows are then checked against them.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax_hpc.config.compose import compose_run_config, default_config_dir
from relax_hpc.data.datasets import build_dataset
from relax_hpc.data.schemas import SCHEMAS, example_rows, png_bytes, write_rows
from relax_hpc.models.tokenizer import build_char_tokenizer

DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\nIn triangle $ABC$, $AB=13$, $BC=14$ and $CA=15$. Find its area.\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
# BytedTsinghua-SIA/DAPO-Math-17k as its Parquet file types it.
DAPO_TYPES = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ]
)
# hiyouga/geometry3k: a Hugging Face Sequence(Image) column is stored as {bytes, path} structs.
GEO3K_TYPES = pa.schema(
    [
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("problem", pa.string()),
        ("answer", pa.string()),
    ]
)


def data_config(name: str, path):
    cfg = compose_run_config(["+experiment=grpo_tiny", f"data={name}", f"data.path={path}"])
    return cfg.data


def test_dapo_math_reads_chat_messages_and_the_nested_ground_truth(tmp_path):
    row = {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PROMPT, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "84", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a1b2c3d4-0000-4000-8000-000000000001"},
    }
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=DAPO_TYPES), path)
    tokenizer = build_char_tokenizer()
    record = build_dataset(data_config("dapo_math", path), tokenizer)[0]
    assert record.prompt == f"user: {DAPO_PROMPT}\nassistant: "
    assert record.answer == "84"
    assert record.metadata == {
        "data_source": "math_dapo",
        "ability": "MATH",
        "extra_info": {"index": "a1b2c3d4-0000-4000-8000-000000000001"},
    }
    assert record.images == ()


def test_geo3k_reads_problem_answer_and_the_image_bytes(tmp_path):
    image = png_bytes(16, 12, seed=3)
    rows = [
        {"images": [{"bytes": image, "path": None}], "problem": "<image>Find x.", "answer": "12"}
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=GEO3K_TYPES), path)
    record = build_dataset(data_config("geo3k", path), build_char_tokenizer())[0]
    assert record.prompt == "user: <image>Find x.\nassistant: "
    assert (record.answer, record.metadata) == ("12", {})
    assert record.images == (image,)
    from PIL import Image  # the bytes are a real PNG (Pillow comes with tensorboard)

    with Image.open(__import__("io").BytesIO(record.images[0])) as decoded:
        assert decoded.size == (16, 12)


def test_prompt_label_reads_slime_jsonl(tmp_path):
    lines = [
        {"prompt": [{"content": "What is 6*7?", "role": "user"}], "label": "42", "metadata": {}},
        {"prompt": "Name the capital of France.", "label": "Paris"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dataset = build_dataset(data_config("prompt_label", path), build_char_tokenizer())
    assert [r.answer for r in dataset] == ["42", "Paris"]
    assert dataset[0].prompt == "user: What is 6*7?\nassistant: "
    assert dataset[0].metadata == {"metadata": {}}


@pytest.mark.parametrize(
    ("name", "published_types"), [("dapo_math", DAPO_TYPES), ("geo3k", GEO3K_TYPES)]
)
def test_example_rows_are_written_in_the_published_parquet_layout(tmp_path, name, published_types):
    schema = SCHEMAS[name]
    path = write_rows(example_rows(schema, "", "")(3), tmp_path / "rows.parquet", "parquet", schema)
    assert pq.read_schema(path).remove_metadata() == published_types
    cfg = data_config(name, path)
    assert len(build_dataset(cfg, build_char_tokenizer())) == 3


def test_every_shipped_data_config_names_a_known_schema_and_its_keys():
    import yaml

    for path in sorted((default_config_dir() / "data").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        schema = SCHEMAS[data.get("schema", "custom")]
        if schema.prompt_key is not None:
            assert (data["prompt_key"], data["answer_key"]) == (
                schema.prompt_key,
                schema.answer_key,
            ), path.name
    shipped = {
        yaml.safe_load(p.read_text()).get("schema") for p in default_config_dir().glob("data/*")
    }
    assert set(SCHEMAS) - {"custom"} <= shipped  # every published schema has a data config


def test_the_schemas_import_no_torch():
    """submit and the miniature read them: no torch, no transformers."""
    import subprocess
    import sys

    code = (
        "import sys, relax_hpc.data.schemas;assert not {'torch', 'transformers'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
