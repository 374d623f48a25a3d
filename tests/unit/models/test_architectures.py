"""Model class names checked at submit without importing torch or transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from relax_hpc.config.errors import ConfigError
from relax_hpc.models import architectures
from relax_hpc.models.architectures import check_transformers_class, transformers_class_names

REPO = Path(__file__).resolve().parents[3]


def cached_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / architectures.CLASS_NAMES_DIR).glob("*.json"))


def test_the_names_are_those_of_the_installed_transformers_and_are_cached(tmp_path):
    version, names = transformers_class_names(tmp_path)
    assert version == transformers.__version__
    assert {"Qwen3ForCausalLM", "Qwen3VLForConditionalGeneration"} <= names
    assert names == {n for n in dir(transformers) if n[:1].isupper()}
    [cached] = cached_files(tmp_path)
    stored = json.loads(cached.read_text())
    assert stored["version"] == version and set(stored["names"]) == names


def test_a_cached_list_is_read_instead_of_transformers(tmp_path):
    transformers_class_names(tmp_path)
    [cached] = cached_files(tmp_path)
    cached.write_text(json.dumps({"version": transformers.__version__, "names": ["OnlyThis"]}))
    assert transformers_class_names(tmp_path)[1] == {"OnlyThis"}


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"version": "0.0.1", "names": ["OnlyThis"]}), json.dumps([1, 2])],
    ids=["corrupt", "another version", "not a mapping"],
)
def test_a_cache_that_is_corrupt_or_of_another_version_is_rebuilt(tmp_path, content):
    transformers_class_names(tmp_path)
    [cached] = cached_files(tmp_path)
    cached.write_text(content)
    assert "Qwen3ForCausalLM" in transformers_class_names(tmp_path)[1]
    assert json.loads(cached.read_text())["version"] == transformers.__version__


def test_a_cache_that_is_a_file_not_a_folder_is_skipped(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    assert "Qwen3ForCausalLM" in transformers_class_names(blocker)[1]


def test_an_unknown_class_is_refused_naming_the_field_and_the_version(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_HPC_CACHE_DIR", str(tmp_path))
    check_transformers_class("Qwen3ForCausalLM", "model.architecture")
    with pytest.raises(ConfigError) as err:
        check_transformers_class("Qwen3ForCausalLMM", "judge.model.architecture")
    assert err.value.field == "judge.model.architecture"
    assert f"transformers {transformers.__version__}" in str(err.value)


PROBE = """
import sys
from relax_hpc.submit import SubmitOptions, prepare
prepare(sys.argv[2:], SubmitOptions(dry_run=sys.argv[1] == "dry"))
print(" ".join(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("experiment", ["grpo_tiny", "grpo_tiny_vl", "grpo_tiny_judge"])
@pytest.mark.parametrize("mode", ["dry", "submit"])
def test_submit_checks_a_run_without_importing_torch_or_transformers(tmp_path, experiment, mode):
    """Importing them is ~2.5 s of a submit's ~3 s; with the class names cached (the first
    submit after an install caches them), checking a run imports neither."""
    env = {**os.environ, "RELAX_HPC_CACHE_DIR": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    transformers_class_names(tmp_path / "cache")
    overrides = [f"+experiment={experiment}", "cluster=local", f"run_dir={tmp_path / 'run'}"]
    loaded = subprocess.run(
        [sys.executable, "-c", PROBE, mode, *overrides],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=REPO,
    ).stdout.split()
    assert loaded == []
