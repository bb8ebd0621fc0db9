"""Who may talk to the engine's client socket, and how its traffic is protected off this host.

On this host the socket is an ``ipc://`` path in a folder only its user can enter, or a
loopback TCP port. Anything else listens for other machines, and is refused unless the
operator asks for it (``--allow-remote``) and gives a key (``--api-key``). A key given for a
TCP socket (and a client that has one) does two things through ZeroMQ's CURVE mechanism: it
encrypts the traffic, and it authenticates both ends. Each end's CURVE keypair is derived
from the shared key, so a client with the key can check it reached the engine, and the
engine accepts no handshake from a client without it (ZeroMQ refuses the connection before
any frame is read).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass

import zmq
import zmq.utils.z85

_TCP = re.compile(r"^tcp://(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:]+)):(?P<port>\d+|\*)$")
_LOOPBACK_NAMES = {"localhost"}


def uses_curve(address: str, api_key: str | None) -> bool:
    """Both ends encrypt and authenticate a TCP connection when they have a key (an
    ``ipc://`` path is protected by its folder's permissions instead)."""
    return api_key is not None and address.startswith("tcp://")


def is_local_address(address: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this host only."""
    if address.startswith("ipc://"):
        return True
    match = _TCP.match(address)
    if match is None:
        return False  # another transport, or an interface name: it listens off this host
    host = match["v6"] or match["host"]
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface or a host name


def reachable_address(requested: str, bound: str) -> str:
    """The address clients reach a socket on that was asked to bind ``requested`` and bound
    ``bound`` (ZeroMQ's last endpoint): ``requested`` itself, with the port the system chose
    where it asked for any (``tcp://127.0.0.1:0`` or ``:*``). The host stays as given: the
    endpoint spells a name or a wildcard as the address it resolved to."""
    asked, got = _TCP.match(requested), _TCP.match(bound)
    if asked is None or got is None or asked["port"] not in ("0", "*"):
        return requested
    return f"{requested[: asked.start('port')]}{got['port']}"


@dataclass(frozen=True)
class CurveKeys:
    """Both ends' CURVE keypairs (Z85), derived from the shared key."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_api_key(cls, api_key: str) -> CurveKeys:
        server_secret = _secret(api_key, b"cbpipe-server")
        client_secret = _secret(api_key, b"cbpipe-client")
        return cls(
            zmq.curve_public(server_secret),
            server_secret,
            zmq.curve_public(client_secret),
            client_secret,
        )

    def make_server(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)

    def make_client(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


def _secret(api_key: str, person: bytes) -> bytes:
    digest = hashlib.blake2b(api_key.encode(), digest_size=32, person=person).digest()
    return zmq.utils.z85.encode(digest)


# --- the worker's results socket --------------------------------------------------------------

RESULTS_TOKEN_BYTES = 16


def new_results_token() -> bytes:
    """A run's secret for its results socket, made by the launcher and known to its children
    only. The socket's folder keeps other users out, but not another process of the same
    user: a ``StepDone`` from one would apply a step's outputs before the device wrote them."""
    return secrets.token_bytes(RESULTS_TOKEN_BYTES)


def seal(token: bytes, frame: bytes) -> bytes:
    """A worker's frame as it goes on the results socket: the run's token first."""
    return token + frame


def unseal(token: bytes, sealed: bytes) -> bytes | None:
    """The frame a worker of this run sealed, or None for one that does not carry the token."""
    if not hmac.compare_digest(sealed[: len(token)], token):
        return None
    return sealed[len(token) :]
