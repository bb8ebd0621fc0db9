"""The environment variables cbpipe reads: every one of them, typed, here."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from cbpipe.config import EngineConfig


@dataclass(frozen=True)
class Environment:
    # CBPIPE_API_KEY: the HTTP API's key when --api-key is not given (a key on the command
    # line is visible to every user of the machine in the process list).
    api_key: str | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> Environment:
        return cls(api_key=environ.get("CBPIPE_API_KEY") or None)

    def apply(self, config: EngineConfig) -> EngineConfig:
        """``config`` with what the environment provides where the flags left it unset."""
        if config.server.api_key is not None or self.api_key is None:
            return config
        server = dataclasses.replace(config.server, api_key=self.api_key)
        return dataclasses.replace(config, server=server)
