"""Every name a config refers to, resolved before anything is submitted (and again at start).

``validate_run_config`` checks values and cross-field rules without importing anything;
this module checks that each *name* stands for something that exists where the job runs:

| field | resolves to |
|---|---|
| ``rollout.environment``, ``rollout.environment_options`` | an environment class (built-in or ``module:Class``, imported) and options it declares; the tokenizer's chat template* and, for ``python_math``, network isolation* |
| ``rollout.reward``, ``rewards.*`` | each reward part: ``judge`` (a judge is configured), a reward model or endpoint of ``rewards``, a built-in reward or ``module:function`` (imported) |
| ``judge.template``, ``judge.verdict`` | a built-in template or text with ``{response}``; a verdict parser |
| ``judge.model.*``, ``rewards.reward_models.*.path`` | a judge class and folder that load; a score head with the label* |
| ``algo.*`` | names and values the estimator and loss functions take (``config/algo.py``; bound by ``algo/registry.py``) |
| ``data.schema``, ``data.*_key`` | a published schema and its keys; the data file's columns* |
| ``data.path``, ``data.eval_path`` | files whose every row reads: UTF-8 JSON objects, a Parquet schema* |
| ``rollout.eval_interval_steps`` | a held-out split (``data.eval_path``) for file datasets |
| ``model.architecture`` | a class of the installed transformers (its names cached per installation: ``models/architectures.py``); the class the folder's config.json names* |
| ``model.path``, ``model.tokenizer`` | a config.json and a tokenizer that load (not the weights)* |
| ``trainer.backend``, ``rollout.backend``, ``judge.backend`` | a registered plug-in (``trainer/registry.py``, ``rollout/engines/registry.py``) or ``module:name`` (imported); the libraries it needs, in the job's interpreter* |
| ``model.modality`` | a modality the trainer and engines carry* |
| ``trainer.backend=megatron`` | an architecture its weight mapping covers* |
| ``cluster.python`` | an executable* |

(*) only with ``check_paths``: when the job is about to run, not when a script is rendered.
Each failure is a ``ConfigError`` naming the field, the known choices and the fix.

Must not: import Hydra, or anything heavy at module level (transformers and torch are
imported by the checks that need them).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from relax_hpc.config import ConfigError, DataConfig, ModelConfig, RunConfig
from relax_hpc.config.rewards import COMPOSITE
from relax_hpc.config.schema import BUILTIN_TOKENIZERS
from relax_hpc.data.scan import DataFileError, scan_columns
from relax_hpc.data.schemas import SCHEMAS
from relax_hpc.models.architectures import (
    check_media_architecture,
    check_transformers_class,
    media_family,
)
from relax_hpc.plugins import PluginError, Registry

FILE_KINDS = ("jsonl", "parquet")
# What the trainer and the engines carry today (images: issue #28); audio comes next.
RUNNABLE_MODALITIES = ("text", "vision", "audio", "omni")
# The architectures the Megatron backend's HF <-> Megatron mapping covers (megatron_mapping).
MEGATRON_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def resolve_names(cfg: RunConfig, check_paths: bool = False) -> None:
    """Raise ``ConfigError`` for the first name in ``cfg`` that resolves to nothing. The data
    checks come first: they import nothing heavy, and a bad data file is then named in
    about a second, not after torch and transformers are imported (algorithm, model)."""
    resolve_data(cfg, check_paths)
    resolve_plugins(cfg)
    resolve_reward_parts(cfg)
    resolve_environment_name(cfg, check_paths)
    resolve_algorithm(cfg)
    resolve_model(cfg.model, check_paths)
    resolve_reward_services(cfg, check_paths)
    if check_paths:
        check_modality(cfg.model)
        check_megatron_architecture(cfg)
        check_backend_libraries(cfg)
        check_interpreter(cfg)


def resolve_reward_name(spec: str) -> None:
    """A rule reward's name (``rollout.reward`` of a run without services)."""
    from relax_hpc.rollout.rewards.registry import RewardNameError, resolve_reward

    try:
        resolve_reward(spec)
    except RewardNameError as err:
        raise ConfigError("rollout.reward", str(err)) from None


def reward_part_fields(cfg: RunConfig) -> dict[str, str]:
    """Every reward part name the config holds -> the field that holds it."""
    rewards = cfg.rewards
    fields = {} if cfg.rollout.reward == COMPOSITE else {cfg.rollout.reward: "rollout.reward"}
    for name in rewards.weights:
        fields.setdefault(name, "rewards.weights")
    for source, table in rewards.weights_by_source.items():
        for name in table:
            fields.setdefault(name, f"rewards.weights_by_source.{source}")
    for field in ("agreement_with", "eval_reward"):
        name = getattr(rewards, field)
        if name:
            fields.setdefault(name, f"rewards.{field}")
    return fields


def _policy_tokenizer(model_cfg):
    """The tokenizer that renders the policy's chat: a media model's is its processor's."""
    from relax_hpc.models.media_policy import is_media_model

    if not is_media_model(model_cfg):
        from relax_hpc.models.build import build_tokenizer

        return build_tokenizer(model_cfg)
    from relax_hpc.media.processor import MediaProcessor
    from relax_hpc.models.multimodal import tiny_processor

    if model_cfg.path is None:
        return tiny_processor(media_family(model_cfg.architecture)).tokenizer
    return MediaProcessor.from_pretrained(model_cfg.path).tokenizer


def resolve_environment_name(cfg: RunConfig, check_paths: bool) -> None:
    """``rollout.environment`` imports and takes its options; with ``check_paths``, the
    policy's tokenizer can render observations and the Python tool can drop its network."""
    spec = cfg.rollout.environment
    if spec is None:
        return
    from relax_hpc.rollout.envs.registry import resolve_environment

    options = cfg.rollout.environment_options
    try:
        env_class = resolve_environment(spec, options)
    except ValueError as err:
        text = str(err)
        options_field = "rollout.environment_options"
        field = options_field if text.startswith(options_field) else "rollout.environment"
        raise ConfigError(field, text) from None
    if not check_paths:
        return
    if _policy_tokenizer(cfg.model).chat_template is None:
        raise ConfigError(
            "rollout.environment",
            f"{spec} renders observations with the tokenizer's chat template and "
            f"{cfg.model.path or cfg.model.tokenizer} has none; use a tokenizer with one",
        )
    if getattr(env_class, "needs_network_isolation", lambda _options: False)(options):
        from relax_hpc.rollout.tools.python_exec import probe_network_isolation

        reason = probe_network_isolation()
        if reason is not None:
            raise ConfigError(
                "rollout.environment_options",
                f"{spec} runs programs without network, but {reason}; allow user "
                "namespaces on the rollout nodes, or set "
                "+rollout.environment_options.network=allow to run them with network",
            )


def resolve_reward_parts(cfg: RunConfig) -> None:
    from relax_hpc.rollout.rewards.registry import RewardNameError, part_kind

    for name, field in reward_part_fields(cfg).items():
        try:
            part_kind(name, cfg.rewards, cfg.judge is not None, field)
        except RewardNameError as err:
            raise ConfigError(field, str(err)) from None


def resolve_reward_services(cfg: RunConfig, check_paths: bool) -> None:
    """The judge's template, verdict and model; with ``check_paths``, the folders load."""
    if cfg.judge is not None:
        from relax_hpc.rollout.rewards.verdicts import TemplateError, template_text

        try:
            template_text(cfg.judge.template)
        except TemplateError as err:
            raise ConfigError("judge.template", str(err)) from None
        resolve_model(cfg.judge.model, check_paths, prefix="judge.model")
    if not check_paths:
        return
    for name, rm in cfg.rewards.reward_models.items():
        if rm.path is None:
            continue  # built from arch: its head was checked against arch.num_labels
        from relax_hpc.models.hf_folder import load_model_config

        field = f"rewards.reward_models.{name}.path"
        labels = getattr(load_model_config(rm.path, field), "num_labels", 0)
        if labels <= rm.label:
            raise ConfigError(
                field,
                f"{rm.path} has a score head of {labels} output(s), so label {rm.label} does "
                f"not exist; set rewards.reward_models.{name}.label",
            )


def resolve_algorithm(cfg: RunConfig) -> None:
    """The algorithm's names and values, from ``config/algo.py`` alone: every estimator and
    loss it accepts is bound in ``algo/registry.py`` (asserted there at import), so the
    trainer binds what is checked here without torch being imported at submit."""
    try:
        cfg.algo.validate()
        cfg.algo.with_algorithm_defaults()
    except ValueError as err:
        text = str(err)
        field = text.split(":")[0] if text.startswith("algo.") else "algo.name"
        raise ConfigError(field, text) from None


def resolve_data(cfg: RunConfig, check_paths: bool) -> None:
    data = cfg.data
    if data.schema not in SCHEMAS:
        raise ConfigError(
            "data.schema",
            f"{data.schema!r} is not a known dataset schema (known: {', '.join(SCHEMAS)}); "
            "use custom with data.prompt_key and data.answer_key for your own layout",
        )
    schema = SCHEMAS[data.schema]
    for field, configured, published in (
        ("prompt_key", data.prompt_key, schema.prompt_key),
        ("answer_key", data.answer_key, schema.answer_key),
    ):
        if published is not None and configured != published:
            raise ConfigError(
                f"data.{field}",
                f"data.schema={schema.name} ({schema.published_as}) keeps it under "
                f"{published!r}, not {configured!r}; set data.{field}={published} or "
                "data.schema=custom",
            )
    if data.kind in FILE_KINDS and cfg.rollout.eval_interval_steps > 0 and not data.eval_path:
        raise ConfigError(
            "rollout.eval_interval_steps",
            f"evaluates every {cfg.rollout.eval_interval_steps} policy versions but "
            "data.eval_path is not set; set data.eval_path (held-out prompts in the same "
            "schema) or rollout.eval_interval_steps=0",
        )
    if check_paths and data.kind in FILE_KINDS:
        for path_field in ("path", "eval_path"):
            path = getattr(data, path_field)
            if path and Path(path).is_file():
                check_columns(data, Path(path), f"data.{path_field}")


def check_columns(data: DataConfig, path: Path, field: str = "data.path") -> None:
    """Every row of ``path`` reads, and the first has the configured keys (and the schema's
    image column); ``field`` is the setting that names the file."""
    schema = SCHEMAS[data.schema]
    try:
        columns = scan_columns(path, data.kind)
    except DataFileError as err:
        raise ConfigError(field, f"{err}; fix the file or {field}") from None
    wanted = {"prompt_key": data.prompt_key, "answer_key": data.answer_key}
    if schema.image_key:
        wanted["schema's image column"] = schema.image_key
    for key_field, key in wanted.items():
        if key not in columns:
            fix = f"fix data.{key_field}" if key_field.endswith("_key") else "fix data.schema"
            shown = ", ".join(sorted(columns)) or "none"
            raise ConfigError(
                f"data.{key_field}" if key_field.endswith("_key") else "data.schema",
                f"{key!r} is not a column of {path} (columns: {shown}); {fix}",
            )


def resolve_model(model: ModelConfig, check_paths: bool, prefix: str = "model") -> None:
    check_transformers_class(model.architecture, f"{prefix}.architecture")
    if model.modality != "text":
        check_media_architecture(model.architecture)
        if model.path is None:
            media_family(model.architecture)  # a built-in media model of that class exists
    if not check_paths:
        return
    if model.path:
        from relax_hpc.models.hf_folder import load_model_config

        architectures = load_model_config(model.path, f"{prefix}.path").architectures or []
        if architectures and model.architecture not in architectures:
            raise ConfigError(
                f"{prefix}.architecture",
                f"{model.path}/config.json names {', '.join(architectures)}, not "
                f"{model.architecture}; set {prefix}.architecture={architectures[0]}",
            )
    check_model_folders(model, prefix)


def check_model_folders(model: ModelConfig, prefix: str) -> None:
    """The reference, teacher and critic configs and the tokenizer load (transformers is
    imported only when the config names one of them)."""
    named = [f for f in ("reference_path", "teacher_path", "critic_path") if getattr(model, f)]
    tokenizer = model.path if model.tokenizer == "auto" else model.tokenizer
    tokenizer_field = f"{prefix}.path" if model.tokenizer == "auto" else f"{prefix}.tokenizer"
    loads_tokenizer = bool(tokenizer) and tokenizer not in BUILTIN_TOKENIZERS
    if not named and not loads_tokenizer:
        return
    from relax_hpc.models.hf_folder import load_model_config, load_tokenizer

    for field in named:
        load_model_config(getattr(model, field), f"{prefix}.{field}")
    if loads_tokenizer:
        load_tokenizer(tokenizer, tokenizer_field)


def check_modality(model: ModelConfig) -> None:
    if model.modality not in RUNNABLE_MODALITIES:
        raise ConfigError(
            "model.modality",
            f"{model.modality} ({model.architecture}) cannot run yet: the trainer and the "
            f"engines carry {', '.join(RUNNABLE_MODALITIES)} (README: Known limitations); "
            "dry_run=true renders the job",
        )


def check_megatron_architecture(cfg: RunConfig) -> None:
    if cfg.trainer.backend == "megatron" and cfg.model.architecture not in MEGATRON_ARCHITECTURES:
        raise ConfigError(
            "trainer.backend",
            f"megatron maps {', '.join(MEGATRON_ARCHITECTURES)} only, not "
            f"{cfg.model.architecture}; use trainer.backend=torch (FSDP2) for this model",
        )


def runs_with_this_interpreter(cfg: RunConfig) -> bool:
    """Whether the job's interpreter is this one, so that what it can import is known here."""
    python = cfg.cluster.python
    # Paths, not files: a virtual environment's python is a link to the base interpreter,
    # yet imports from another site-packages.
    return bool(python) and os.path.abspath(python) == os.path.abspath(sys.executable)


def plugin_registries(cfg: RunConfig) -> list[tuple[Registry, str]]:
    """(registry, the name the config gives it) for every plug-in the run builds."""
    from relax_hpc.rollout.engines.registry import ENGINES, JUDGE_ENGINES
    from relax_hpc.trainer.registry import TRAINER_BACKENDS

    named = [(TRAINER_BACKENDS, cfg.trainer.backend), (ENGINES, cfg.rollout.backend)]
    if cfg.judge is not None:
        named.append((JUDGE_ENGINES, cfg.judge.backend))
    return named


def resolve_plugins(cfg: RunConfig) -> None:
    """Each backend a built-in or an importable ``module:name`` (a built-in is not imported:
    its library may exist only where the job runs)."""
    for registry, spec in plugin_registries(cfg):
        try:
            if registry.plugin(spec).target == spec:
                registry.load(spec)
        except PluginError as err:
            raise ConfigError(err.field, str(err)) from None


def check_backend_libraries(cfg: RunConfig) -> None:
    """The libraries each backend needs, when the job runs with this interpreter."""
    if not runs_with_this_interpreter(cfg):
        return  # another interpreter (or one set up by cluster.setup): nothing to ask here
    for registry, spec in plugin_registries(cfg):
        try:
            registry.check_libraries(spec, sys.executable)
        except PluginError as err:
            raise ConfigError(err.field, str(err)) from None


def check_interpreter(cfg: RunConfig) -> None:
    python = cfg.cluster.python
    if cfg.cluster.setup or not python:
        return  # cluster.setup may create or activate it on the nodes
    if shutil.which(python) is None:
        raise ConfigError(
            "cluster.python",
            f"{python} is not an executable here; leave cluster.python unset (the interpreter "
            "that ran submit) or point it at the environment relax_hpc is installed in",
        )
