"""ASGI guards in front of the app: the Host check (DNS rebinding) and the bounded body read (size and time).

Both are pure ASGI middlewares (streaming responses pass untouched) and answer with OpenAI error objects, which is
why starlette's TrustedHostMiddleware and FastAPI's max_body_size (plain-text answers) are not used.
"""
from __future__ import annotations

import asyncio
import ipaddress

from starlette.datastructures import Headers

from .protocol import error_response
from .serving import RequestError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"


def default_allowed_hosts(bind_host: str) -> list[str]:
    """The Host names a server bound to `bind_host` answers by default: the bound address, plus the loopback names
    when it is a loopback address. A wildcard bind (0.0.0.0, ::) answers any name: it has no one name to check, and
    its warning about a missing --api-key already says that anyone can reach it."""
    try:
        address = ipaddress.ip_address(bind_host)
    except ValueError:
        address = None
    if address is not None and address.is_unspecified:
        return [ANY_HOST]
    names = [bind_host.lower()]
    if bind_host == "localhost" or (address is not None and address.is_loopback):
        names += [n for n in LOOPBACK_NAMES if n not in names]
    return names


def host_name(header: str) -> str:
    """The name in a Host header, without its port: 'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.partition(":")[0] if header.count(":") == 1 else header


class HostCheck:
    """Answer 400 to a request whose Host header names a host the server does not serve.

    A keyless server on loopback is otherwise reachable from any web page through DNS rebinding: the page's own
    domain, re-pointed at 127.0.0.1, arrives with that domain in Host."""

    def __init__(self, app, allowed_hosts):
        self.app = app
        self.allowed = {h.strip().lower().strip("[]") for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and ANY_HOST not in self.allowed:
            host = Headers(scope=scope).get("host", "")
            if host_name(host) not in self.allowed:
                e = RequestError(f"the Host header {host!r} names a host this server does not answer for (start it "
                                 f"with --allowed-host NAME to add one)", code="invalid_host")
                return await error_response(e)(scope, receive, send)
        await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class BodyLimits:
    """Read a request's whole body before the app runs: at most max_bytes (else 413), within timeout_s of the
    headers (else 408, and the connection is closed), so that neither a huge nor a half-sent body can hold the
    server. The app then receives the body in one message. A client that disconnects mid-body gets no answer
    (nobody would read it) and the app never runs.

    Neither uvicorn nor starlette bounds the time (uvicorn's `timeout_keep_alive` only runs between requests).
    FastAPI's `max_body_size` bounds the size, but answers a body declared too large in plain text, replacing the
    app's answer, where clients expect an OpenAI error object."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        if max_bytes <= 0 or not 0 < timeout_s < float("inf"):
            raise ValueError(f"the body limits must be positive, got {max_bytes} bytes and {timeout_s} s")
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            body = await self._read(scope, receive)
        except ClientGone:
            return
        except RequestError as e:
            return await error_response(e)(scope, receive, send)
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()          # later reads wait for the client's disconnect, as usual
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self) -> RequestError:
        return RequestError(f"the request body is larger than this server's limit of {self.max_bytes} bytes",
                            status=413, code="request_too_large")

    async def _read(self, scope, receive) -> bytes:
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large()            # before reading any of it
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise self._too_large()
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise RequestError(f"the request body did not arrive within {self.timeout_s:g} s", status=408,
                               code="request_timeout", headers={"Connection": "close"}) from None
