"""The plug-in registries and their one ``package.module:name`` resolver (relax_hpc/plugins.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_hpc.config import ConfigError
from relax_hpc.config.compose import compose_run_config
from relax_hpc.plugins import Plugin, PluginError, Registry, import_object
from relax_hpc.resolve import check_backend_libraries, resolve_plugins
from relax_hpc.rollout.engines.registry import ENGINES, JUDGE_ENGINES
from relax_hpc.trainer.registry import TRAINER_BACKENDS


def test_the_resolver_names_the_field_and_what_is_wrong():
    assert import_object("json:dumps", "f", "function") is __import__("json").dumps
    assert import_object("collections:OrderedDict", "f", "class").__name__ == "OrderedDict"
    assert import_object("os.path:join", "f").__name__ == "join"
    for spec, text in (
        ("json", "f: 'json': write it as package.module:function"),
        ("no_such_pkg_x:f", "f: cannot import 'no_such_pkg_x' for 'no_such_pkg_x:f'"),
        ("json:nope", "f: json has no function 'nope'; fix the name after the colon"),
        ("json:__name__", "f: json has no function '__name__'"),  # a string is not callable
    ):
        with pytest.raises(PluginError, match=text) as err:
            import_object(spec, "f", "function")
        assert err.value.field == "f"
    with pytest.raises(PluginError, match="has no class 'dumps'"):
        import_object("json:dumps", "f", "class")


def test_a_registry_knows_built_ins_and_takes_module_names_of_ones_own():
    registry = Registry(
        "x.backend",
        "thing",
        {
            "one": Plugin("json:JSONDecoder", ("json",)),
            "gpu": Plugin("json:JSONDecoder", ("no_lib_x.core",), "gpu"),
        },
    )
    assert registry.names() == ("one", "gpu")
    assert registry.load("one").__name__ == "JSONDecoder"
    assert registry.load("collections:OrderedDict").__name__ == "OrderedDict"
    with pytest.raises(PluginError, match=r"x.backend: 'two' is not a built-in thing \(one, gpu\)"):
        registry.plugin("two")
    assert registry.missing_libraries("one") == []
    assert registry.missing_libraries("gpu") == ["no_lib_x.core"]
    registry.check_libraries("one", "/py")
    with pytest.raises(PluginError) as err:
        registry.check_libraries("gpu", "/py")
    assert err.value.field == "x.backend"
    assert "gpu needs no_lib_x.core, which /py cannot import" in str(err.value)
    assert 'pip install -e ".[gpu]"' in str(err.value)


def test_the_built_in_backends_and_engines_are_registered():
    assert TRAINER_BACKENDS.names() == ("torch", "megatron")
    assert ENGINES.names() == ("transformers", "sglang") == JUDGE_ENGINES.names()
    assert TRAINER_BACKENDS.plugin("megatron").extra == ENGINES.plugin("sglang").extra == "gpu"
    assert TRAINER_BACKENDS.load("torch").__name__ == "TorchBackend"
    assert ENGINES.load("transformers").__name__ == "TransformersBuilder"
    assert ENGINES.load("sglang").__name__ == "SGLangBuilder"  # SGLang itself is not imported


def test_registries_import_no_torch_and_no_engine():
    """Validation reads them on a login node (checked in a fresh process)."""
    probe = (
        "import sys, relax_hpc.trainer.registry, relax_hpc.rollout.engines.registry; "
        "print(' '.join(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'sglang', 'megatron')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    assert loaded == []


@pytest.mark.parametrize(
    ("override", "field", "text"),
    [
        ("trainer.backend=jax", "trainer.backend", "'jax' is not a built-in trainer backend"),
        ("rollout.backend=vllm", "rollout.backend", "'vllm' is not a built-in engine"),
        ("rollout.backend=no_pkg_x:Builder", "rollout.backend", "cannot import 'no_pkg_x'"),
        ("trainer.backend=json:Nope", "trainer.backend", "json has no class 'Nope'"),
    ],
)
def test_a_backend_name_that_stands_for_nothing_is_a_config_error(override, field, text):
    cfg = compose_run_config(["+experiment=grpo_tiny", override])
    with pytest.raises(ConfigError, match=text) as err:
        resolve_plugins(cfg)
    assert err.value.field == field


def test_a_judge_engine_is_checked_like_the_policy_engine():
    cfg = compose_run_config(["+experiment=grpo_tiny_judge", "judge.backend=vllm"])
    with pytest.raises(ConfigError, match="'vllm' is not a built-in judge engine") as err:
        resolve_plugins(cfg)
    assert err.value.field == "judge.backend"


def test_a_module_name_plugin_needs_no_library_check():
    cfg = compose_run_config(
        [
            "+experiment=grpo_tiny",
            "rollout.backend=relax_hpc.rollout.engines.transformers_builder:TransformersBuilder",
            f"cluster.python={sys.executable}",
        ]
    )
    resolve_plugins(cfg)
    check_backend_libraries(cfg)
