"""AlgoConfig defaults and validation, the YAML group, and the package's import boundary."""

import ast
import dataclasses
from pathlib import Path

import pytest
import yaml

from relax_hpc.algo.registry import resolve
from relax_hpc.config.algo import ALGORITHM_NAMES, AlgoConfig

REPO = Path(__file__).resolve().parents[3]
YAML_FILES = sorted((REPO / "configs" / "algo").glob("*.yaml"))
ALLOWED_IMPORTS = {
    "torch",
    "math",
    "dataclasses",
    "typing",
    "functools",
    "collections",
    "__future__",
}


def test_every_algorithm_has_a_yaml_that_loads_and_validates():
    assert sorted(f.stem for f in YAML_FILES) == sorted(ALGORITHM_NAMES)
    for path in YAML_FILES:
        values = yaml.safe_load(path.read_text())
        # Interpolations into other groups (e.g. ${rollout.max_new_tokens}) resolve only when
        # Hydra composes the whole run (tests/unit/test_config.py composes every algorithm);
        # here a number stands in for them.
        values = {
            k: 512.0 if isinstance(v, str) and v.startswith("${") else v for k, v in values.items()
        }
        assert values["name"] == path.stem
        cfg = AlgoConfig(**values)
        cfg.validate()
        defaults = AlgoConfig()
        redundant = [k for k, v in values.items() if k != "name" and getattr(defaults, k) == v]
        assert not redundant, f"{path.name} repeats dataclass defaults: {redundant}"


def test_documented_defaults():
    cfg = AlgoConfig(name="ppo")
    assert (cfg.clip_low, cfg.clip_high, cfg.dual_clip_c) == (0.2, 0.2, 3.0)
    assert (cfg.gamma, cfg.lam, cfg.value_clip) == (1.0, 1.0, 0.5)
    assert (cfg.gspo_clip_low, cfg.gspo_clip_high) == (3e-4, 4e-4)
    assert (cfg.sapo_tau_pos, cfg.sapo_tau_neg) == (1.0, 1.05)
    assert (cfg.cispo_clip_low, cfg.cispo_clip_high) == (1.0, 4.0)
    assert (cfg.m2po_budget, cfg.m2po_min_clip_low, cfg.m2po_min_clip_high) == (0.01, 0.3, 0.5)
    assert (cfg.tis_mode, cfg.tis_level, cfg.tis_cap, cfg.tis_low) == ("none", "token", 2.0, 0.0)
    assert (cfg.opd_mode, cfg.opd_kl_type) == ("advantage", "reverse_kl")
    assert cfg.kl_loss_coef == cfg.kl_in_reward_coef == cfg.entropy_coef == 0.0
    assert (
        AlgoConfig(**yaml.safe_load((REPO / "configs/algo/opd.yaml").read_text())).opd_coef == 1.0
    )


def test_fields_are_omegaconf_friendly():
    allowed = {"str", "int", "float", "bool", "str | None", "float | None", "bool | None"}
    for field in dataclasses.fields(AlgoConfig):
        assert field.type in allowed, f"{field.name}: {field.type}"


def test_omegaconf_structured_config_round_trip():
    omegaconf = pytest.importorskip("omegaconf")
    schema = omegaconf.OmegaConf.structured(AlgoConfig)
    assert omegaconf.OmegaConf.is_missing(schema, "name")
    merged = omegaconf.OmegaConf.merge(schema, {"name": "grpo", "clip_high": 0.28})
    with pytest.raises(omegaconf.ValidationError):
        merged.dual_clip_c = "three"
    cfg = omegaconf.OmegaConf.to_object(merged)
    assert isinstance(cfg, AlgoConfig) and cfg.clip_high == 0.28
    cfg.validate()


def test_dapo_style_grpo_is_expressible():
    spec = resolve(AlgoConfig(name="grpo", clip_high=0.28, tis_mode="truncate"))
    assert spec.config.clip_high == 0.28
    assert spec.needs_rollout_logprobs
    assert spec.loss_agg_mode == "token-mean"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": "???"}, "algo.name is required"),
        ({"name": "dapo"}, "algo.name='dapo' is not known"),
        ({"advantage_estimator": "vtrace"}, "algo.advantage_estimator"),
        ({"policy_loss": "dpo"}, "algo.policy_loss"),
        ({"loss_agg_mode": "sum"}, "algo.loss_agg_mode"),
        ({"kl_loss_type": "k4"}, "algo.kl_loss_type"),
        ({"kl_in_reward_type": "k3-"}, "algo.kl_in_reward_type"),
        ({"tis_mode": "clip"}, "algo.tis_mode"),
        ({"tis_level": "batch"}, "algo.tis_level"),
        ({"opd_mode": "both"}, "algo.opd_mode"),
        ({"opd_kl_type": "forward_kl"}, "algo.opd_kl_type"),
        ({"dual_clip_c": 1.0}, "algo.dual_clip_c"),
        ({"clip_low": -0.1}, "algo.clip_low"),
        ({"clip_low": 1.5}, "algo.clip_low"),
        ({"entropy_coef": -0.01}, "algo.entropy_coef"),
        ({"kl_loss_coef": -1.0}, "algo.kl_loss_coef"),
        ({"gamma": 1.1}, "algo.gamma"),
        ({"lam": -0.1}, "algo.lam"),
        ({"value_clip": 0.0}, "algo.value_clip"),
        ({"sapo_tau_neg": 0.0}, "algo.sapo_tau_neg"),
        ({"m2po_budget": 0.0}, "algo.m2po_budget"),
        ({"tis_cap": 0.0}, "algo.tis_cap"),
        ({"clip_high": float("nan")}, "algo.clip_high"),
        ({"kl_loss_coef": 0.1, "kl_in_reward_coef": 0.1}, "set one of them to 0"),
        ({"use_rollout_logprobs": True, "tis_mode": "mask"}, "algo.use_rollout_logprobs"),
        ({"opd_only_reward": True}, "algo.opd_only_reward"),
        ({"opd_is_clip": 2.0}, "algo.opd_is_clip"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "algo.loss_scale_factor"),
        ({"loss_scale_factor": -1.0}, "algo.loss_scale_factor"),
    ],
)
def test_validate_names_the_field(overrides, message):
    cfg = AlgoConfig(**{"name": "grpo", **overrides})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        cfg.validate()


def test_dr_grpo_without_constant_normaliser_is_rejected():
    with pytest.raises(ValueError, match="algo.loss_scale_factor"):
        AlgoConfig(name="dr_grpo").validate()


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gspo"])
def test_group_estimators_reject_one_sample_per_prompt(name):
    cfg = AlgoConfig(name=name)
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        cfg.check_samples_per_prompt(1)
    cfg.check_samples_per_prompt(2)


@pytest.mark.parametrize("name", ["ppo", "reinforce_pp"])
def test_non_group_estimators_accept_one_sample_per_prompt(name):
    AlgoConfig(name=name).check_samples_per_prompt(1)


def test_algo_imports_nothing_else_of_ours():
    package = REPO / "relax_hpc" / "algo"
    for module in package.rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{module.name}: use absolute imports"
                roots = [node.module or ""]
            elif isinstance(node, ast.Attribute) and node.attr == "distributed":
                raise AssertionError(f"{module.name} uses torch.distributed")
            else:
                continue
            for name in roots:
                ok = name.split(".")[0] in ALLOWED_IMPORTS or name.startswith(
                    ("relax_hpc.algo", "relax_hpc.config.algo")  # its config dataclass
                )
                assert ok, f"{module.name} imports {name}"
