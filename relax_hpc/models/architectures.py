"""Model class names, checked at submit without importing torch or transformers.

``submit`` checks that ``model.architecture`` names a class of the installed transformers.
Importing transformers (and with it torch) costs ~2.5 s of CPU, most of a submit's time, so
the class names are read once per installed transformers and kept in the user's cache
(``paths.default_cache_dir``), keyed by its version, location and modification times: an
upgrade, a reinstall or an edited checkout gets a fresh list. A cache that cannot be read or
written is rebuilt or skipped, never trusted half-written (it is published by rename).

The built-in media families live here too, so that naming one is checked without torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

from relax_hpc.config.errors import ConfigError
from relax_hpc.paths import atomic_write_json, default_cache_dir

# The built-in tiny media models: family -> the transformers class it builds.
ARCHITECTURES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen2_5_omni": "Qwen2_5OmniThinkerForConditionalGeneration",
    "qwen3_omni": "Qwen3OmniMoeThinkerForConditionalGeneration",
}
# A whole Omni model's class (thinker + talker + code2wav, as Qwen publishes it) -> the
# thinker's class. RL trains and serves text only, so only the thinker is loaded; its weights
# sit under ``thinker.`` and its config under ``thinker_config``.
OMNI_THINKERS = {
    "Qwen2_5OmniForConditionalGeneration": "Qwen2_5OmniThinkerForConditionalGeneration",
    "Qwen3OmniMoeForConditionalGeneration": "Qwen3OmniMoeThinkerForConditionalGeneration",
}
# Media model classes refused at submit, with the reason (ConfigError on model.architecture).
REFUSED_ARCHITECTURES = {
    "Qwen2AudioForConditionalGeneration": (
        "Qwen2-Audio (audio only) is not supported: it marks clips with "
        "<|audio_bos|>/<|audio_eos|> and has no vision tower, and no media family here "
        "(media/markup.py) renders, counts or serves its prompts; train audio with a "
        "Qwen2.5-Omni or Qwen3-Omni thinker (Qwen2_5OmniThinkerForConditionalGeneration)"
    ),
}
CLASS_NAMES_DIR = "transformers_classes"  # in the user's cache: one file per installation


def check_transformers_class(architecture: str, field: str) -> None:
    """``ConfigError`` on ``field`` when the installed transformers has no ``architecture``."""
    version, names = transformers_class_names()
    if architecture not in names:
        raise ConfigError(
            field,
            f"{architecture!r} is not a model class of transformers {version}; use the class "
            "named in the model's config.json (e.g. Qwen3ForCausalLM, Qwen3MoeForCausalLM)",
        )


def transformers_class_names(cache_dir: Path | None = None) -> tuple[str, frozenset[str]]:
    """(version, the public names of the installed transformers), from the cache if it
    holds this installation's list, else by importing transformers (then cached)."""
    version = importlib.metadata.version("transformers")
    path = (cache_dir or default_cache_dir()) / CLASS_NAMES_DIR / f"{_install_key(version)}.json"
    cached = _read_names(path, version)
    if cached is not None:
        return version, cached
    import transformers  # the slow path: once per installation

    names = frozenset(name for name in dir(transformers) if name[:1].isupper())
    # A home that cannot be written: every submit imports transformers, as before the cache.
    with contextlib.suppress(OSError):
        atomic_write_json(path, {"version": version, "names": sorted(names)}, durable=False)
    return version, names


def _install_key(version: str) -> str:
    """What identifies an installation: version, place, and when its package was changed
    (its ``__init__.py`` and ``models/`` folder: a model added in a checkout moves it)."""
    spec = importlib.util.find_spec("transformers")  # finds the package without running it
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    stamps = [version, str(origin)]
    if origin is not None:
        for part in (origin, origin.parent / "models"):
            stamps.append(str(part.stat().st_mtime_ns) if part.exists() else "-")
    return hashlib.sha256("|".join(stamps).encode()).hexdigest()[:24]


def _read_names(path: Path, version: str) -> frozenset[str] | None:
    """The cached names, or None when the file is missing, unreadable or not this version's."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("version") != version:
        return None
    names = stored.get("names")
    if not isinstance(names, list) or not names:
        return None
    return frozenset(str(name) for name in names)


def check_media_architecture(architecture: str) -> None:
    """``ConfigError`` with the reason when ``architecture`` is a refused media class."""
    if architecture in REFUSED_ARCHITECTURES:
        raise ConfigError("model.architecture", REFUSED_ARCHITECTURES[architecture])


def media_family(architecture: str) -> str:
    """The tiny-model family (``ARCHITECTURES``) of ``model.architecture``; a whole Omni
    class's is its thinker's (the part a run trains)."""
    check_media_architecture(architecture)
    thinker = OMNI_THINKERS.get(architecture, architecture)
    for family, name in ARCHITECTURES.items():
        if name == thinker:
            return family
    raise ConfigError(
        "model.architecture",
        f"{architecture!r} has no built-in media model; use one of "
        f"{', '.join(ARCHITECTURES.values())}, or set model.path to a local folder",
    )
