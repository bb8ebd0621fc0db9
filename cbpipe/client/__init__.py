"""Submit jobs to a running cbpipe engine and stream their tokens back.

Depends on the protocol, pyzmq and msgpack only: it imports without torch.
``Client`` is for threads, ``AsyncClient`` for asyncio; both keep the same contract.
"""

from cbpipe.client.async_client import AsyncClient, AsyncJob
from cbpipe.client.client import Client, Job
from cbpipe.client.jobs import (
    Delta,
    EngineBusy,
    EngineError,
    PromptLogprob,
    RequestError,
    Result,
    SamplingOptions,
)
from cbpipe.protocol.messages import Stats
from cbpipe.protocol.sampling import StructuredOutput

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "Client",
    "Delta",
    "EngineBusy",
    "EngineError",
    "Job",
    "PromptLogprob",
    "RequestError",
    "Result",
    "SamplingOptions",
    "Stats",
    "StructuredOutput",
]
