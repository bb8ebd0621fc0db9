"""Submit jobs to a running cbpipe engine and stream their tokens back.

Depends on the protocol, pyzmq and msgpack only: it imports without torch.
"""

from cbpipe.client.client import Client, EngineError, Job, RequestError, Result

__all__ = ["Client", "EngineError", "Job", "RequestError", "Result"]
