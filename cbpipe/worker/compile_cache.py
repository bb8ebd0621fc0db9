"""Compiled artifacts kept between launches.

``torch.compile`` (inductor's FX graph and kernel caches) and Triton (our kernels, and the
ones inductor writes) cache what they compile on disk; by default under ``/tmp``, which a
machine may clear, and shared by every version of everything. The worker points both at a
folder of the user's cache (``--compile-cache-dir``) named after what must match for an
artifact to be reused: cbpipe's, torch's and Triton's versions, the device, the model's
configuration and the dtype. A second launch of the same model then finds its kernels,
and a different model, dtype or version never meets a stale one. Variables the user set
(``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) win.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path

import torch
from transformers import PretrainedConfig

from cbpipe import env

log = logging.getLogger("cbpipe.worker")

CACHE_VARIABLES = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR"}


def cache_key(config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> str:
    """A short name for everything an artifact's reuse depends on."""
    facts = {
        "cbpipe": _version("cbpipe"),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "device": _device_name(device),
        "dtype": str(dtype),
        "model": config.to_json_string(use_diff=False),
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()
    return digest[:16]


def use_compile_cache(
    setting: str | None, config: PretrainedConfig, dtype: torch.dtype, device: torch.device
) -> Path | None:
    """Point inductor's and Triton's caches at this model's folder; returns it (None: off).

    Must run before anything compiles: both read the variables when they first cache."""
    if setting == "off":
        return None
    root = Path(setting) if setting else env.cache_dir()
    folder = root / "compile" / cache_key(config, dtype, device)
    for part, variable in CACHE_VARIABLES.items():
        if _set_by_user(variable):
            log.info("%s cache: %s (from %s)", part, os.environ[variable], variable)
            continue
        path = folder / part
        path.mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(path)
    log.info("compile cache: %s", folder)
    return folder


def _set_by_user(variable: str) -> bool:
    """Whether ``variable`` names a folder someone chose. Importing inductor's configuration
    sets ``TORCHINDUCTOR_CACHE_DIR`` to inductor's own default (``cache_dir_utils.cache_dir``
    writes it back), and the worker's imports do that before this runs: that value is not a
    choice, and taking it for one put every model's artifacts in one folder under /tmp."""
    value = os.environ.get(variable)
    if value is None:
        return False
    if variable == CACHE_VARIABLES["inductor"]:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(value) != os.path.abspath(default_cache_dir())
    return True


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    properties = torch.cuda.get_device_properties(device)
    return f"{properties.name} sm_{properties.major}{properties.minor}"
