"""Which models a server may serve: `--model` (repeatable, `NAME=PATH` to name one) and every
checkpoint in `--models-dir`, each with the `ServerSettings` it loads with.

The first model is the server's primary one: it loads at start, its `--served-model-name`,
LoRA adapters and translation languages are the settings' own; the others load on demand
(serving/http/model_pool.py) with the same engine options.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from metrale_jax.errors import InvalidParameterError
from serving.http.settings import ServerSettings

DEFAULT_POOL_KEEP_ALIVE = 300.0  # seconds an idle model stays loaded when there are several
WEIGHT_SUFFIXES = (".gguf",)


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
    """One servable model: `name` (what requests send as `model`), `settings` (what its
    `ModelRuntime` loads with: `model` its path or name, `served_model_name` its name) and
    `primary` (the first one: loaded at start, its LoRA adapters)."""

    name: str
    settings: ServerSettings
    primary: bool


def split_named(value: str) -> tuple[str | None, str]:
    """`NAME=PATH` as (NAME, PATH); anything else as (None, value)."""
    name, sep, path = value.partition("=")
    if sep and name and path and "/" not in name:
        return name, path
    return None, value


def models_in_dir(folder: str) -> dict[str, str]:
    """The checkpoints in `folder` by name: each sub-folder holding a Hugging Face model
    (config.json) or a Metrale checkpoint (metrale.json) under its folder name, each .gguf
    file under its name without the suffix. Raises `InvalidParameterError` for a missing
    folder."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise InvalidParameterError(f"--models-dir {folder}: not a folder", param="models_dir")
    found: dict[str, str] = {}
    for path in sorted(root.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_dir() and any((path / f).is_file() for f in ("config.json", "metrale.json")):
            found[path.name] = str(path)
        elif path.is_file() and path.suffix in WEIGHT_SUFFIXES:
            found[path.stem] = str(path)
    return found


def catalog(settings: ServerSettings) -> list[CatalogEntry]:
    """Every servable model of `settings`, the primary (`settings.model`) first. Raises
    `InvalidParameterError` for two models of one name."""
    entries = [CatalogEntry(settings.model_name, settings, True)]
    extra: list[tuple[str, str]] = []
    for value in settings.models:
        name, path = split_named(value)
        extra.append((name or path, path))
    if settings.models_dir:
        extra.extend(models_in_dir(settings.models_dir).items())
    seen = {settings.model_name}
    for name, path in extra:
        if name in seen:
            if name == settings.model_name and path == settings.model:
                continue  # the primary model listed again (in --models-dir)
            raise InvalidParameterError(f"two models are named {name!r}; name one with "
                                        "--model NAME=PATH", param="model")
        seen.add(name)
        entries.append(CatalogEntry(name, dataclasses.replace(
            settings, model=path, served_model_name=name, loras={}, active_lora={},
            source_lang=None, target_lang=None, models=(), models_dir=None), False))
    return entries


_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_keep_alive(value: object, param: str = "keep_alive") -> float:
    """Ollama's `keep_alive`: a number of seconds or a duration ("30s", "5m", "1h", "1h30m"
    is not one: one unit), 0 (unload once answered) or any negative value (never unload on
    its own): seconds, `math.inf` for never. Raises `InvalidParameterError` otherwise."""
    if isinstance(value, bool) or value is None:
        raise InvalidParameterError(f"{param} must be a duration (\"5m\", \"30s\"), a number "
                                    "of seconds, 0 or -1", param=param)
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise InvalidParameterError(
                f"{param} {value!r}: expected a duration such as \"5m\", \"30s\" or \"1h\", a "
                "number of seconds, 0 or -1", param=param)
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if math.isnan(seconds):
        raise InvalidParameterError(f"{param} must be a number", param=param)
    return math.inf if seconds < 0 else seconds


def format_keep_alive(seconds: float) -> str | int:
    """A keep-alive for the stats: -1 for never, else whole seconds."""
    return -1 if math.isinf(seconds) else int(seconds) if seconds == int(seconds) else seconds
