"""Reading the small JSON files beside a Hugging Face tokenizer.

A model folder says which tokens are special, whether to add bos, and its chat template, in
`tokenizer_config.json`, `special_tokens_map.json`, `chat_template.jinja` and
`generation_config.json`. Both the `tokenizer.json` and the `tokenizer.model` backends read them
through `read_tokenizer_files`, the same way transformers does (the config wins over the map).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metrale_jax.errors import CheckpointError

logger = logging.getLogger(__name__)

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_CHAT_TEMPLATE_FILE = "chat_template.json"

_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class AddedTokenSpec:
    """One entry of `added_tokens_decoder`: a token matched whole in the text.

    Attributes mirror `tokenizers.AddedToken`: `special` tokens are dropped by
    `decode(skip_special_tokens=True)`; `lstrip`/`rstrip` make the match eat the whitespace on
    that side; `normalized` matches the token after normalization.
    """

    content: str
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False
    single_word: bool = False


@dataclass(frozen=True)
class TokenizerFiles:
    """What a model folder says about its tokenizer, beyond the vocabulary itself.

    `add_bos_token`/`add_eos_token`/`legacy`/`add_prefix_space` are None when the files do not
    say (each backend then has its own default). `generation_eos_ids` are the extra ids that end
    generation from `generation_config.json`.
    """

    folder: Path
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    extra_special_tokens: tuple[str, ...] = ()
    added_tokens: dict[int, AddedTokenSpec] = field(default_factory=dict)
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    legacy: bool | None = None
    add_prefix_space: bool | None = None
    chat_template: str | None = None
    generation_eos_ids: tuple[int, ...] = ()
    tokenizer_class: str | None = None

    def named_tokens(self) -> dict[str, str]:
        """`{"bos_token": ..., "eos_token": ..., ...}` for the named tokens that are set."""
        values = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        return {key: value for key, value in values.items() if value is not None}


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; a file that is not a JSON object raises CheckpointError."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def token_content(value: Any) -> str | None:
    """The text of a token written as a string or as `{"content": ...}` (None stays None)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _token_list(value: Any) -> list[str]:
    items = value.values() if isinstance(value, dict) else value or []
    return [text for text in (token_content(item) for item in items) if text is not None]


def _added_tokens(raw: Any, path: Path) -> dict[int, AddedTokenSpec]:
    if not isinstance(raw, dict):
        return {}
    specs: dict[int, AddedTokenSpec] = {}
    for key, entry in raw.items():
        try:
            token_id = int(key)
        except ValueError as err:
            raise CheckpointError(f"{path}: added_tokens_decoder key {key!r} is not an id") from err
        if isinstance(entry, str):
            specs[token_id] = AddedTokenSpec(entry)
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise CheckpointError(f"{path}: added_tokens_decoder[{key}] has no content")
        specs[token_id] = AddedTokenSpec(
            content=entry["content"],
            special=bool(entry.get("special", True)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", False)),
            single_word=bool(entry.get("single_word", False)),
        )
    return specs


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    # A processor's template (vision-language models: `{"chat_template": "..."}`), where
    # the tokenizer has none.
    processor_file = folder / PROCESSOR_CHAT_TEMPLATE_FILE
    if processor_file.is_file():
        try:
            template = json.loads(processor_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None
        template = template.get("chat_template") if isinstance(template, dict) else None
        return template if isinstance(template, str) else None
    return None


def _generation_eos_ids(folder: Path) -> tuple[int, ...]:
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        return ()
    value = read_json(path).get("eos_token_id")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def _optional_bool(config: dict[str, Any], key: str) -> bool | None:
    value = config.get(key)
    return None if value is None else bool(value)


def read_tokenizer_files(folder: Path) -> TokenizerFiles:
    """Read the tokenizer side files of a Hugging Face model folder (all of them optional)."""
    folder = Path(folder)
    config_path = folder / TOKENIZER_CONFIG
    config = read_json(config_path) if config_path.is_file() else {}
    map_path = folder / SPECIAL_TOKENS_MAP
    token_map = read_json(map_path) if map_path.is_file() else {}
    merged = {**token_map, **{k: v for k, v in config.items() if v is not None}}

    extra: list[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        for source in (token_map, config):
            for text in _token_list(source.get(key)):
                if text not in extra:
                    extra.append(text)

    files = TokenizerFiles(
        folder=folder,
        **{key: token_content(merged.get(key)) for key in _NAMED},
        extra_special_tokens=tuple(extra),
        added_tokens=_added_tokens(config.get("added_tokens_decoder"), config_path),
        add_bos_token=_optional_bool(config, "add_bos_token"),
        add_eos_token=_optional_bool(config, "add_eos_token"),
        legacy=_optional_bool(config, "legacy"),
        add_prefix_space=_optional_bool(config, "add_prefix_space"),
        chat_template=_chat_template(folder, config),
        generation_eos_ids=_generation_eos_ids(folder),
        tokenizer_class=config.get("tokenizer_class"),
    )
    logger.debug("tokenizer files of %s: %s", folder, files.named_tokens())
    return files
