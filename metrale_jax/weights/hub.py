"""Models by Hugging Face Hub name: resolves `org/repo`, `org/repo:QUANT`, `org/repo/file.gguf`,
each optionally `@revision`, to a local path in the Hub's cache, downloading what is missing.

Everything goes through `huggingface_hub` itself, so its cache is the one transformers and
vLLM share, and its environment applies unchanged: `HF_HOME` / `HF_HUB_CACHE` (where),
`HF_TOKEN` (gated and private repos), `HF_HUB_OFFLINE=1` (the cache only), `HF_ENDPOINT` (a
mirror), and its progress bars (`HF_HUB_DISABLE_PROGRESS_BARS=1` hides them).

- `org/repo` with safetensors: only the files the loaders read (`SAFETENSORS_FILES`).
- `org/repo:QUANT`, or `org/repo` holding only GGUFs: the `.gguf` whose name holds the tag
  (case-insensitive; llama.cpp's `-hf` convention, `Q4_K_M` when no tag is given).
- `org/repo/path/file.gguf`: that file.
Hub failures become `ModelNotFoundError` (no such repo, revision or file; gated; offline and
not cached), `CheckpointError` (a repo we cannot read) or `FetchError` (the Hub unreachable).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path

from metrale_jax.errors import CheckpointError, FetchError, ModelNotFoundError

log = logging.getLogger(__name__)

SAFETENSORS_FILES = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "processor_config.json"]
"""The files of a safetensors repo that the loaders read (`allow_patterns`)."""

DEFAULT_QUANT = "Q4_K_M"
"""The GGUF picked from a repo of GGUFs named without a tag (as llama.cpp's `-hf` does)."""

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_NAME = re.compile(
    rf"^(?P<repo>{_PART}/{_PART})(?P<file>(?:/{_PART})*\.gguf)?"
    rf"(?::(?P<quant>{_PART}))?(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]*))?$")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclasses.dataclass(frozen=True)
class HubName:
    """A parsed Hub model name: `repo_id` (`org/repo`), `filename` (a `.gguf` inside it, or
    None), `quant` (the tag after `:`, or None), `revision` (after `@`, or None: `main`)."""

    repo_id: str
    filename: str | None = None
    quant: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.filename}" if self.filename else "")
        return text + (f":{self.quant}" if self.quant else "") + (
            f"@{self.revision}" if self.revision else "")


def parse_hub_name(name: str) -> HubName | None:
    """Parses `org/repo[/file.gguf][:QUANT][@revision]`; None when `name` is not of that form
    (a path such as `./x`, `/abs/x`, `~/x` or one of more parts never is)."""
    match = _HUB_NAME.match(name)
    if match is None or (match["file"] and match["quant"]):
        return None
    file = match["file"][1:] if match["file"] else None
    return HubName(match["repo"], file, match["quant"], match["rev"])


def looks_like_hub_name(name: str) -> bool:
    """Whether `name` has the form of a Hub model name (see `parse_hub_name`)."""
    return parse_hub_name(name) is not None


def resolve_hub_name(name: str) -> Path:
    """Downloads (or finds in the Hub cache) the model `name` names and returns its local
    path: the snapshot folder of a safetensors repo, or the `.gguf` file of a GGUF repo.
    Raises `ModelNotFoundError`, `CheckpointError` or `FetchError` naming the repo."""
    from huggingface_hub import constants
    hub = parse_hub_name(name)
    if hub is None:
        raise ModelNotFoundError(f"{name!r} is not a Hugging Face repo name (org/repo)")
    # `metrale serve` resolves a name twice (is it a translation model? then load it): the
    # second time asks the Hub nothing
    key = (name, constants.ENDPOINT, constants.HF_HUB_CACHE, constants.is_offline_mode())
    if key in _RESOLVED and _RESOLVED[key].exists():
        return _RESOLVED[key]
    with _hub_errors(hub):
        if hub.filename is not None:
            path = _download_gguf(hub, hub.filename)
        else:
            files = _repo_files(hub)
            ggufs = sorted(f for f in files if f.endswith(".gguf"))
            if hub.quant is None and ("config.json" in files or not ggufs):
                path = _download_safetensors(hub, files)
            else:
                path = _download_gguf(hub, pick_gguf(hub, ggufs))
    _RESOLVED[key] = path
    return path


_RESOLVED: dict[tuple[str, str, str, bool], Path] = {}
"""The paths this process resolved, by (name, endpoint, cache folder, offline)."""


def pick_gguf(hub: HubName, ggufs: list[str]) -> str:
    """The `.gguf` of `ggufs` that `hub.quant` picks (its first part for a split model, whose
    parts the GGUF reader joins): a name holding the tag as a whole word first, else
    holding it at all; `DEFAULT_QUANT` or the only file without a tag. Raises
    `ModelNotFoundError` listing the files when none or several match."""
    weights = [f for f in ggufs if "mmproj" not in f.lower()]
    listing = ", ".join(weights) or "none"
    if not weights:
        raise ModelNotFoundError(f"Hugging Face repo {hub.repo_id} has no .gguf model files")
    tag = hub.quant or DEFAULT_QUANT
    word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
    for matches in ([f for f in weights if word.search(Path(f).name)],
                    [f for f in weights if tag.lower() in Path(f).name.lower()]):
        single = [f for f in matches if not _SHARD.search(f)]
        firsts = [f for f in matches if (m := _SHARD.search(f)) and m[1] == "00001"]
        if len(single) == 1 or (not single and len(firsts) == 1):
            return (single or firsts)[0]
        if len(single) > 1:
            raise ModelNotFoundError(
                f"{hub}: the tag {tag!r} matches several GGUF files of {hub.repo_id} "
                f"({', '.join(single)}); name one (org/repo/file.gguf)")
    if hub.quant is None and len(weights) == 1:
        return weights[0]
    if hub.quant is None:
        raise ModelNotFoundError(
            f"{hub}: Hugging Face repo {hub.repo_id} has several GGUF files and none is "
            f"{DEFAULT_QUANT}; add a tag (org/repo:QUANT). Files: {listing}")
    raise ModelNotFoundError(
        f"{hub}: no GGUF file of Hugging Face repo {hub.repo_id} matches {hub.quant!r}. "
        f"Files: {listing}")


def _repo_files(hub: HubName) -> list[str]:
    """The repo's file names at the revision: from the Hub (one `model_info` request, no
    retries), or, offline or with the Hub unreachable, from the tree listing a download
    cached (else the library's error, which says why)."""
    import huggingface_hub as hf
    from huggingface_hub import constants, errors
    unreachable: Exception
    if constants.is_offline_mode():
        unreachable = errors.OfflineModeIsEnabled("HF_HUB_OFFLINE is set")
    else:
        try:
            info = hf.HfApi().model_info(hub.repo_id, revision=hub.revision)
            return [s.rfilename for s in info.siblings or ()]
        except (errors.OfflineModeIsEnabled, ConnectionError, TimeoutError) as e:
            unreachable = e
        except Exception as e:
            if not type(e).__module__.startswith("httpx"):  # the Hub answered: its error
                raise
            unreachable = e
    try:
        return [f.path for f in hf.get_cached_repo_tree(hub.repo_id, revision=hub.revision)]
    except errors.CachedRepoTreeNotFoundError:
        raise unreachable from None


def _download_safetensors(hub: HubName, files: list[str]) -> Path:
    """The snapshot folder of a safetensors repo with the files the loaders read."""
    import huggingface_hub as hf
    if "config.json" not in files:
        raise CheckpointError(
            f"Hugging Face repo {hub.repo_id} has no config.json and no .gguf files; not a "
            f"model Metrale can load (files: {', '.join(sorted(files)[:12]) or 'none'})")
    if not any(f.endswith(".safetensors") for f in files):
        raise CheckpointError(
            f"Hugging Face repo {hub.repo_id} has no .safetensors weights (only PyTorch .bin "
            "files?); Metrale reads safetensors and GGUF")
    folder = hf.snapshot_download(hub.repo_id, revision=hub.revision,
                                  allow_patterns=SAFETENSORS_FILES)
    log.info("%s: %s", hub, folder)
    return Path(folder)


def _download_gguf(hub: HubName, filename: str) -> Path:
    """The local path of `filename`, a `.gguf` of the repo; for a split model
    (`PREFIX-00001-of-0000N.gguf`) every part is downloaded beside it and the first part's
    path returned (the GGUF reader joins them)."""
    import huggingface_hub as hf
    from huggingface_hub import constants, errors
    wanted = [filename]
    shard = _SHARD.search(filename)
    if shard:
        count = int(shard[2])
        wanted = [_SHARD.sub(f"-{i:05d}-of-{count:05d}.gguf", filename)
                  for i in range(1, count + 1)]
    # a snapshot (not hf_hub_download) caches the repo's file list too: offline, a tag still
    # finds its file
    folder = Path(hf.snapshot_download(hub.repo_id, revision=hub.revision,
                                       allow_patterns=wanted))
    for name in wanted:
        if not (folder / name).is_file():
            if constants.is_offline_mode():
                raise errors.OfflineModeIsEnabled(f"{name} is not in {folder}")
            raise ModelNotFoundError(f"Hugging Face repo {hub.repo_id} has no file {name!r}")
    path = folder / filename
    log.info("%s: %s", hub, path)
    return path


@contextlib.contextmanager
def _hub_errors(hub: HubName) -> Iterator[None]:
    """Turns `huggingface_hub`'s exceptions into Metrale's, each naming the repo."""
    try:
        yield
    except Exception as error:
        mapped = describe_hub_error(hub, error)
        if mapped is None:
            raise
        raise mapped from error


def describe_hub_error(hub: HubName, error: Exception) -> Exception | None:
    """The Metrale error for `huggingface_hub`'s `error` while fetching `hub`, or None for an
    error that is not the Hub's (it propagates unchanged)."""
    from huggingface_hub import constants, errors
    repo, endpoint = hub.repo_id, constants.ENDPOINT
    if isinstance(error, errors.GatedRepoError):
        return ModelNotFoundError(
            f"Hugging Face repo {repo} is gated: accept its license on {endpoint}/{repo} "
            "(logged in), then set HF_TOKEN to an access token of that account "
            f"({endpoint}/settings/tokens)")
    if isinstance(error, errors.RepositoryNotFoundError):
        return ModelNotFoundError(
            f"model {str(hub)!r} not found: no such file or folder, and no Hugging Face repo "
            f"{repo} at {endpoint} (a private repo needs HF_TOKEN)")
    if isinstance(error, errors.RevisionNotFoundError):
        return ModelNotFoundError(
            f"Hugging Face repo {repo} has no revision {hub.revision!r} (a branch, tag or "
            "commit)")
    if isinstance(error, errors.RemoteEntryNotFoundError):
        return ModelNotFoundError(f"Hugging Face repo {repo} has no file {hub.filename!r}")
    if isinstance(error, errors.HFValidationError):
        return ModelNotFoundError(f"{str(hub)!r} is not a valid Hugging Face repo name: "
                                  f"{_first_line(error)}")
    if isinstance(error, errors.HfHubHTTPError) and error.response is not None and (
            error.response.status_code in (401, 403)):
        return ModelNotFoundError(
            f"the Hugging Face Hub at {endpoint} refused access to {repo} "
            f"({error.response.status_code}): check HF_TOKEN")
    if isinstance(error, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        if constants.is_offline_mode():
            return ModelNotFoundError(
                f"HF_HUB_OFFLINE is set and {hub} is not (fully) in the Hugging Face cache "
                f"{constants.HF_HUB_CACHE}; fetch it once online (`metrale pull {hub}`)")
        return FetchError(f"could not reach the Hugging Face Hub at {endpoint} for {repo}, "
                          f"and it is not in the cache: {_first_line(error)}")
    if isinstance(error, (errors.HfHubHTTPError, ConnectionError, OSError)):
        return FetchError(f"fetching {hub} from the Hugging Face Hub at {endpoint} failed: "
                          f"{_first_line(error)}")
    if type(error).__module__.startswith("httpx"):
        return FetchError(f"could not reach the Hugging Face Hub at {endpoint} for {repo}: "
                          f"{_first_line(error)}")
    return None


def _first_line(error: Exception) -> str:
    """The first non-empty line of an exception's message (the library's run several)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
