"""Models named by their Hugging Face Hub id (``meta-llama/Llama-3.1-8B-Instruct``).

The launcher fetches a Hub model into the local Hugging Face cache once, before any child
starts (``fetch``); every process then finds the same snapshot folder in the cache without
asking the Hub (``cached_snapshot``), so a launch with the model cached needs no network,
and ``HF_HUB_OFFLINE=1`` works as in transformers. ``HF_TOKEN`` reaches gated models;
``HF_HUB_CACHE`` (or ``HF_HOME``) moves the cache.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# A Hub id: a name, or an owner and a name (letters, digits, "-", "_", ".").
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# What serving needs: configuration, tokenizer, chat template and safetensors weights. Other
# weight formats a repository may carry as well (.bin, .pth, GGUF, an "original" folder of
# the publisher's own format) would multiply the download.
_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
_SKIPPED = ["original/*", "*/original/*"]


class HubError(ValueError):
    """A Hub model that is not cached and could not be fetched; the message says why."""


def is_hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None and ".." not in name


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (a branch, tag or commit;
    default main), or None; never asks the Hub."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=_FILES,
            ignore_patterns=_SKIPPED,
            local_files_only=True,
        )
    except LocalEntryNotFoundError:
        return None
    return Path(folder)


def fetch(repo_id: str, revision: str | None = None) -> Path:
    """``repo_id``'s snapshot folder at ``revision``, downloaded into the cache unless it is
    there already.

    Raises ``HubError`` for a model that is neither cached nor downloadable (no network,
    ``HF_HUB_OFFLINE``, no such repository, a gated one without a token), or that has no
    safetensors weights.
    """
    folder = cached_snapshot(repo_id, revision)
    if folder is None:
        folder = _download(repo_id, revision)
    if not any(folder.glob("*.safetensors")):
        raise HubError(
            f"{repo_id} has no safetensors weights in {folder}: cbpipe loads only those "
            "(convert the checkpoint, or point --model at a folder that has them)"
        )
    return folder


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    if HF_HUB_OFFLINE:
        raise HubError(
            f"model {repo_id!r} is not in the Hugging Face cache ({HF_HUB_CACHE}) and "
            "HF_HUB_OFFLINE is set: download it first, or unset HF_HUB_OFFLINE"
        )
    _look_up(repo_id, revision)
    # A download takes minutes: say so, whatever the log level (once the Hub has the model:
    # a typo is not downloaded), and show its bars where someone watches.
    at = f" at {revision}" if revision else ""
    print(f"cbpipe-launch: downloading {repo_id}{at} into {HF_HUB_CACHE}", file=sys.stderr)
    were_disabled = are_progress_bars_disabled()
    if sys.stderr.isatty():
        enable_progress_bars()
    else:
        disable_progress_bars()
    try:
        folder = snapshot_download(
            repo_id, revision=revision, allow_patterns=_FILES, ignore_patterns=_SKIPPED
        )
    except LocalEntryNotFoundError:  # the Hub could not be reached
        raise HubError(
            f"model {repo_id!r} is not in the Hugging Face cache ({HF_HUB_CACHE}) and the "
            "Hub could not be reached"
        ) from None
    except HfHubHTTPError as exc:  # a gated one, an outage
        raise _not_downloadable(repo_id, exc) from None
    finally:
        (disable_progress_bars if were_disabled else enable_progress_bars)()
    log.info("downloaded %s to %s", repo_id, folder)
    return Path(folder)


def _look_up(repo_id: str, revision: str | None) -> None:
    """Raises ``HubError`` unless the Hub confirms that ``repo_id`` has ``revision``."""
    from huggingface_hub import HfApi
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().repo_info(repo_id, revision=revision)
    except HfHubHTTPError as exc:  # no such repository or revision, a private one, an outage
        raise _not_downloadable(repo_id, exc) from None
    except Exception as exc:  # the HTTP library's own: no network, no name service, a timeout
        raise HubError(
            f"model {repo_id!r} is not in the Hugging Face cache ({HF_HUB_CACHE}) and the "
            f"Hub could not be reached ({type(exc).__name__}: {exc})"
        ) from None


def _not_downloadable(repo_id: str, exc: Exception) -> HubError:
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    hint = "" if os.environ.get("HF_TOKEN") else " (a gated model needs HF_TOKEN)"
    return HubError(f"model {repo_id!r} could not be downloaded: {first_line}{hint}")
