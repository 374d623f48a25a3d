"""Reward-endpoint tokens: where they come from, and how they stay out of configs and logs.

The places are those of alert URLs (``observe.alerts``): a ``token`` written in a config is
moved at submission into the run's ``secrets/endpoint-<name>.token`` (0600) and
``config.yaml`` keeps none; else ``token_file`` (a 0600 file), else the environment
variable ``token_env``. Once read, a token is masked in every log record of the process.

Must not: log a token, or put one in a failure reason.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from relax_hpc.config import ConfigError
from relax_hpc.config.rewards import EndpointConfig, RewardsConfig
from relax_hpc.observe.redaction import mask_in_logs, read_secret_file
from relax_hpc.paths import RunPaths, atomic_write_text


def endpoint_token(
    name: str,
    endpoint: EndpointConfig,
    paths: RunPaths | None,
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """The token of endpoint ``name``, masked in logs from now on; None if it has none."""
    token = _find_token(name, endpoint, paths, environ)
    if token:
        mask_in_logs([token])
    return token


def _find_token(
    name: str, endpoint: EndpointConfig, paths: RunPaths | None, environ: Mapping[str, str]
) -> str | None:
    field = f"rewards.endpoints.{name}"
    if paths is not None and paths.endpoint_token_file(name).is_file():
        return read_secret_file(paths.endpoint_token_file(name), field).strip()
    if endpoint.token:
        return endpoint.token
    if endpoint.token_file:
        path = Path(endpoint.token_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"{field}.token_file", f"{path} is not a file; fix the path")
        return read_secret_file(path, field).strip()
    if endpoint.token_env:
        value = environ.get(endpoint.token_env, "").strip()
        if not value:
            raise ConfigError(
                f"{field}.token_env",
                f"${endpoint.token_env} is empty or not set where the rollout runs; export it "
                "before submitting (Slurm passes the environment on) or set it in "
                "cluster.setup",
            )
        return value
    return None


def move_endpoint_tokens_to_secrets(rewards: RewardsConfig, paths: RunPaths) -> RewardsConfig:
    """Config-given tokens go to 0600 files of the run; the returned config holds none."""
    if not any(endpoint.token for endpoint in rewards.endpoints.values()):
        return rewards
    paths.secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    endpoints = {}
    for name, endpoint in rewards.endpoints.items():
        if endpoint.token:
            atomic_write_text(paths.endpoint_token_file(name), endpoint.token + "\n", mode=0o600)
            endpoint = replace(endpoint, token=None)
        endpoints[name] = endpoint
    return replace(rewards, endpoints=endpoints)
