"""Hugging Face Hub ids where hfjax takes a directory: `model_path: Qwen/Qwen2.5-0.5B-Instruct` resolves to a local
snapshot (`huggingface_hub.snapshot_download`: the local cache first, downloading what is missing when online;
with `HF_HUB_OFFLINE=1` the cache only), and dataset repositories for `hfjax data`.

A run resolves its ids once, on the controller, before any worker starts; a run over several hosts needs the cache
(`HF_HOME` / `HF_HUB_CACHE`) on storage every host sees, or the model downloaded to the same path on each.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hfjax.typed_config import ConfigError

MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]  # config, weights, tokenizer
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as `org/name` and is not a local path."""
    return bool(_HUB_ID.match(path)) and not Path(path).expanduser().exists()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")


def snapshot(repo_id: str, field: str, repo_type: str = "model", patterns: list[str] | None = None) -> Path:
    """The local directory of `repo_id` (downloaded when missing and online); ConfigError naming `field` when it is
    neither cached nor downloadable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns, local_files_only=offline())
    except LocalEntryNotFoundError as exc:
        where = "HF_HUB_OFFLINE is set, so only the local cache is read" if offline() else "and it cannot be downloaded"
        raise ConfigError(
            f"{field}: {repo_id!r} is not in the local Hugging Face cache ({_cache_dir()}), {where}; download it "
            "first or give a local directory"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(f"{field}: cannot fetch {repo_id!r} from the Hugging Face Hub ({exc})") from exc
    return Path(path)


def resolve_model(path: str, field: str) -> str:
    """`path` when it is local (or empty); the snapshot directory when it is a Hub id."""
    return str(snapshot(path, field, patterns=MODEL_FILES)) if path and is_hub_id(path) else path


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
