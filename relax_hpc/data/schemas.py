"""Published dataset schemas: where each keeps its prompt, answer and images, and example rows.

``data.schema`` names one of ``SCHEMAS``. A named schema fixes ``data.prompt_key`` and
``data.answer_key`` (checked at submit) and says which column holds images; ``custom`` takes
the keys as configured. Each schema also writes a few *example rows* in exactly its published
layout (nested columns, chat-message lists, PNG bytes): the data of a miniature run
(``relax_hpc.miniature``) and of the tests.

| schema | published as | prompt | answer | images |
|---|---|---|---|---|
| ``dapo_math`` | DAPO-Math-17k (Parquet, verl layout) | ``prompt`` (chat messages) | ``reward_model.ground_truth`` | - |
| ``geo3k`` | Geometry3K (Parquet, Hugging Face ``Image`` feature) | ``problem`` (``<image>`` + text) | ``answer`` | ``images`` (``{bytes, path}`` list) |
| ``prompt_label`` | slime/Relax JSONL | ``prompt`` (chat messages or text) | ``label`` | - |
| ``omni_mc`` | ours (below), Parquet with HF ``Image``/``Audio`` structs | ``prompt`` (chat messages, typed parts) | ``answer`` (A-D) | ``images`` and ``audio`` |
| ``custom`` | your own rows | ``data.prompt_key`` | ``data.answer_key`` | - |

``omni_mc``: image-and-audio multiple choice, one row per question. No published dataset
holds both in one training row in a layout we could adopt as is (OmniBench is a benchmark
without a train split), so the layout is documented here (docs/multimodal.md) in the form Hugging
Face datasets give ``Image`` and ``Audio`` features in Parquet: ``images`` and ``audio``
lists of ``{"bytes", "path"}`` structs (encoded PNG/JPEG, WAV/FLAC), ``prompt`` chat messages
whose ``content`` is a list of ``{"type": "image"|"audio"|"text", "text"}`` parts (one media
part per list item, in order), ``options`` the choices and ``answer`` the letter; the
``multiple_choice`` reward scores the completion's final choice.

Must not: import torch or transformers (``submit`` and the miniature use it); pyarrow is
imported only to write Parquet.
"""

from __future__ import annotations

import io
import json
import math
import struct
import wave
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.paths import atomic_write_bytes, atomic_write_text

Row = dict[str, Any]

# DAPO-Math-17k's instruction around every problem (the "Answer:" convention of its reward).
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    'problem.\n\n{problem}\n\nRemember to put your answer on its own line after "Answer:".'
)
# slime's DAPO-Math JSONL asks for the answer boxed.
SLIME_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: \\boxed{{$Answer}} where $Answer is the answer to the problem.\n\n"
    '{problem}\n\nRemember to put your answer on its own line after "Answer:".'
)
MATH_PROBLEMS = (
    ("Let $x$ and $y$ be positive real numbers with $x+y=10$ and $xy=21$. Find $x^2+y^2$.", "58"),
    ("How many positive divisors does $360$ have?", "24"),
    ("The sum of three consecutive integers is $72$. What is the largest of them?", "25"),
    ("Find the remainder when $2^{10}$ is divided by $7$.", "2"),
    ("A rectangle has perimeter $30$ and area $56$. Find the length of its longer side.", "8"),
    ("If $\\frac{a}{b}=\\frac{3}{4}$ and $a+b=28$, find $b$.", "16"),
    ("Compute $\\binom{8}{3}$.", "56"),
    ("What is the smallest prime greater than $90$?", "97"),
)
GEOMETRY_PROBLEMS = (
    ("<image>Find x.", "12"),
    ("<image>Find the area of the triangle. Round to the nearest tenth if necessary.", "24"),
    ("<image>Find m \\angle 2.", "60"),
    ("<image>Find the perimeter of the parallelogram.", "36"),
    ("<image>Find y.", "2\\sqrt{3}"),
    ("<image>Find the length of \\widehat{AB}. Round to the nearest hundredth.", "7.85"),
)


@dataclass(frozen=True)
class DataSchema:
    name: str
    published_as: str
    prompt_key: str | None  # None: as configured (custom)
    answer_key: str | None
    image_key: str | None = None
    example_rows: Callable[[int, int], list[Row]] | None = None  # (count, first index)
    parquet_types: Callable[[], Any] | None = None  # the exact pyarrow schema, when published

    def keys(self, prompt_key: str, answer_key: str) -> tuple[str, str]:
        """The prompt and answer keys rows are read with (a named schema's own)."""
        return self.prompt_key or prompt_key, self.answer_key or answer_key


def dapo_math_rows(count: int, first: int = 0) -> list[Row]:
    """Rows as BytedTsinghua-SIA/DAPO-Math-17k publishes them (verl's Parquet layout)."""
    rows = []
    for index in range(first, first + count):
        problem, answer = MATH_PROBLEMS[index % len(MATH_PROBLEMS)]
        rows.append(
            {
                "data_source": "math_dapo",
                "prompt": [{"content": DAPO_INSTRUCTION.format(problem=problem), "role": "user"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"{index:08x}-0000-4000-8000-000000000000"},
            }
        )
    return rows


def dapo_math_types():
    import pyarrow as pa

    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.string())])),
        ]
    )


def geo3k_rows(count: int, first: int = 0) -> list[Row]:
    """Rows as hiyouga/geometry3k publishes them: one PNG per problem, as a Hugging Face
    ``Image`` feature stores it in Parquet (``{"bytes", "path"}``)."""
    rows = []
    for index in range(first, first + count):
        problem, answer = GEOMETRY_PROBLEMS[index % len(GEOMETRY_PROBLEMS)]
        image = {"bytes": png_bytes(32, 24, seed=index), "path": None}
        rows.append({"images": [image], "problem": problem, "answer": answer})
    return rows


def geo3k_types():
    import pyarrow as pa

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.schema(
        [("images", pa.list_(image)), ("problem", pa.string()), ("answer", pa.string())]
    )


def prompt_label_rows(count: int, first: int = 0) -> list[Row]:
    """Rows of slime's (and Relax's) JSONL: chat messages under ``prompt``, ``label``."""
    rows = []
    for index in range(first, first + count):
        problem, answer = MATH_PROBLEMS[index % len(MATH_PROBLEMS)]
        content = SLIME_INSTRUCTION.format(problem=problem)
        rows.append({"prompt": [{"content": content, "role": "user"}], "label": answer})
    return rows


OMNI_QUESTIONS = (
    ("Is the tone you hear higher than the line in the picture is long?", ("yes", "no")),
    ("Which describes the picture and the sound together?", ("a line and a tone", "silence")),
)


def omni_mc_rows(count: int, first: int = 0) -> list[Row]:
    """``omni_mc`` rows: one PNG and one WAV clip per question (documented above)."""
    rows = []
    for index in range(first, first + count):
        question, options = OMNI_QUESTIONS[index % len(OMNI_QUESTIONS)]
        letters = "AB"
        text = question + " " + " ".join(f"{k}. {o}" for k, o in zip(letters, options, strict=True))
        content = [
            {"type": "image", "text": None},
            {"type": "audio", "text": None},
            {"type": "text", "text": text},
        ]
        rows.append(
            {
                "images": [{"bytes": png_bytes(32, 24, seed=index), "path": None}],
                "audio": [{"bytes": wav_bytes(0.5, 220.0 * (1 + index % 4)), "path": None}],
                "prompt": [{"role": "user", "content": content}],
                "options": list(options),
                "answer": letters[index % 2],
            }
        )
    return rows


def omni_mc_types():
    import pyarrow as pa

    media = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    return pa.schema(
        [
            ("images", media),
            ("audio", media),
            ("prompt", pa.list_(message)),
            ("options", pa.list_(pa.string())),
            ("answer", pa.string()),
        ]
    )


def custom_rows(prompt_key: str, answer_key: str) -> Callable[[int, int], list[Row]]:
    """Plain question/answer rows under the configured (possibly dotted) keys."""

    def rows(count: int, first: int = 0) -> list[Row]:
        made = []
        for index in range(first, first + count):
            problem, answer = MATH_PROBLEMS[index % len(MATH_PROBLEMS)]
            row: Row = {}
            _put(row, prompt_key, problem)
            _put(row, answer_key, answer)
            made.append(row)
        return made

    return rows


SCHEMAS: dict[str, DataSchema] = {
    "custom": DataSchema("custom", "your own rows (data.prompt_key, data.answer_key)", None, None),
    "dapo_math": DataSchema(
        "dapo_math",
        "DAPO-Math-17k Parquet",
        "prompt",
        "reward_model.ground_truth",
        example_rows=dapo_math_rows,
        parquet_types=dapo_math_types,
    ),
    "geo3k": DataSchema(
        "geo3k",
        "Geometry3K Parquet",
        "problem",
        "answer",
        image_key="images",
        example_rows=geo3k_rows,
        parquet_types=geo3k_types,
    ),
    "prompt_label": DataSchema(
        "prompt_label", "slime/Relax JSONL", "prompt", "label", example_rows=prompt_label_rows
    ),
    "omni_mc": DataSchema(
        "omni_mc",
        "image-and-audio multiple choice Parquet (documented in data/schemas.py)",
        "prompt",
        "answer",
        image_key="images",  # its audio column is data.audio_key's default, audio
        example_rows=omni_mc_rows,
        parquet_types=omni_mc_types,
    ),
}


def example_rows(schema: DataSchema, prompt_key: str, answer_key: str) -> Callable:
    """The schema's row generator; ``custom`` builds rows under the configured keys."""
    return schema.example_rows or custom_rows(*schema.keys(prompt_key, answer_key))


def write_rows(rows: list[Row], path: Path, kind: str, schema: DataSchema) -> Path:
    """``rows`` as a ``jsonl`` or ``parquet`` file (atomically; Parquet with the schema's types)."""
    if kind == "jsonl":
        return atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    assert kind == "parquet", kind
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = schema.parquet_types() if schema.parquet_types else None
    table = pa.Table.from_pylist(rows, schema=types)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return atomic_write_bytes(path, sink.getvalue().to_pybytes())


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A small RGB PNG (a diagonal line on a tinted ground), written with zlib only."""
    ground = (200 + seed * 7 % 50, 220, 240 - seed * 11 % 60)
    raw = bytearray()
    for y in range(height):
        raw.append(0)  # filter type 0 for each scanline
        for x in range(width):
            raw += bytes((20, 20, 20)) if abs(x * height - y * width) < width else bytes(ground)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    idat = zlib.compress(bytes(raw))
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def wav_bytes(seconds: float, frequency_hz: float, rate_hz: int = 16000) -> bytes:
    """A mono 16-bit PCM WAV of a sine tone, written with the standard library only."""
    num_frames = int(seconds * rate_hz)
    samples = (
        int(9830 * math.sin(2 * math.pi * frequency_hz * i / rate_hz)) for i in range(num_frames)
    )
    out = io.BytesIO()
    with wave.open(out, "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(rate_hz)
        handle.writeframes(b"".join(struct.pack("<h", s) for s in samples))
    return out.getvalue()


def _put(row: Row, dotted_key: str, value: Any) -> None:
    *parents, last = dotted_key.split(".")
    for part in parents:
        row = row.setdefault(part, {})
    row[last] = value
