"""`oled serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Binds to loopback by default. The decoding flags (--gen-length, --block-length, --threshold, ...) set the defaults
of requests that leave those fields out (--gen-length is the default max_tokens).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys

from ..engine import Engine
from ..server import BODY_TIMEOUT_S, MAX_BODY_BYTES, require_serve_deps
from ..server.header_deadline import HEADER_TIMEOUT_S, header_deadline_protocol
from .common import add_decode_args, add_engine_args, decode_params, engine_config


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve the model over an OpenAI-compatible HTTP API: /v1/models, /v1/completions, "
                                   "/v1/chat/completions (streaming with server-sent events), /health, /metrics.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    g.add_argument("--api-key", default=os.environ.get("OLED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $OLED_API_KEY)")
    g.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for the engine; more get HTTP 429 (default: 16)")
    g.add_argument("--served-model-name", help="the model id clients send (default: the model directory's name)")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (repeatable; '*' answers any). Default: "
                        "the bound address, and localhost, 127.0.0.1 and ::1 on loopback (a defence against DNS "
                        "rebinding); any name on a wildcard address such as 0.0.0.0")
    g.add_argument("--max-body-mib", type=float, default=MAX_BODY_BYTES / 2**20,
                   help=f"largest request body in MiB; larger ones get HTTP 413 (default: {MAX_BODY_BYTES // 2**20})")
    g.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="SECONDS",
                   help=f"time a request body may take to arrive; slower ones get HTTP 408 and their connection is "
                        f"closed (default: {BODY_TIMEOUT_S:g})")
    g.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="SECONDS",
                   help=f"time a request's line and headers may take to arrive (from the connection's start or the "
                        f"request's first byte); slower ones get HTTP 408 and their connection is closed "
                        f"(default: {HEADER_TIMEOUT_S:g})")
    add_engine_args(p)
    add_decode_args(p)


def _listen(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {port}")
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.create_server(addr[:2], family=family, backlog=128)
    except (OSError, socket.gaierror) as e:
        reason = str(e.strerror or e).split(" (while attempting")[0]
        raise OSError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args) -> int:
    require_serve_deps()
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not args.max_body_mib > 0 or args.max_body_mib == float("inf"):
        raise ValueError(f"--max-body-mib must be a positive number, got {args.max_body_mib}")
    for flag, value in (("--body-timeout", args.body_timeout), ("--header-timeout", args.header_timeout)):
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
    defaults = decode_params(args)
    defaults.validate()
    sock = _listen(args.host, args.port)     # before loading: a busy port fails fast

    try:
        import uvicorn  # optional: the serve extra

        from ..server.guards import default_allowed_hosts  # optional: the serve extra
        from ..server.routes import create_app  # optional: the serve extra

        engine = Engine(engine_config(args), progress=True)
        allowed_hosts = default_allowed_hosts(args.host) + args.allowed_host
        app = create_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                         max_queue=args.max_queue, defaults=defaults, allowed_hosts=allowed_hosts,
                         max_body_bytes=int(args.max_body_mib * 2**20), body_timeout_s=args.body_timeout)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    name = args.served_model_name or engine.model_name
    print(f"oled serve: {engine.describe()}", file=sys.stderr)
    print(f"oled serve: serving {name!r} at http://{url_host}:{port}/v1 (queue limit {args.max_queue}"
          f"{', API key required' if args.api_key else ''}); Ctrl-C stops", file=sys.stderr, flush=True)
    if not _is_loopback(host) and not args.api_key:
        print(f"oled serve: warning: listening on {host} without --api-key: anyone who can reach this machine "
              f"can use the server", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="info" if args.verbose else "warning", access_log=args.verbose,
                            timeout_graceful_shutdown=5, lifespan="on",
                            http=header_deadline_protocol(args.header_timeout))
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 0
