"""The dashboard's web server (the ``[dashboard]`` extra: Starlette served by uvicorn).

Three routes: ``/`` the page and ``/dashboard.js`` its script (both shipped in the package:
nothing is fetched from the internet), and ``/api/state`` the run as JSON (`Board.state`),
which asks for ``Authorization: Bearer <token>`` when the server has a token. A thread reads
Redis every `interval_s`; requests only read what it last read, so a page open in many tabs
costs Redis nothing more.

Where it listens: loopback by default. Any other address needs HTTPS (a certificate and its
key) and a token, or it is refused before anything starts (`check_bind`).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from importlib import resources
from pathlib import Path

from ops.tools.dashboard import Board
from workers.common import loopback_host

log = logging.getLogger(__name__)
DASHBOARD_EXTRA = "the dashboard needs its extra: pip install 'decoupled-diloco[dashboard]'"
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; connect-src 'self'; "
                               "style-src 'unsafe-inline'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store"}


def check_bind(host: str, *, certfile: str | None, keyfile: str | None,
               token: str | None) -> str | None:
    """Why the dashboard may not listen on `host` this way (None: it may)."""
    if bool(certfile) != bool(keyfile):
        return "--tls-cert and --tls-key go together"
    if loopback_host(host):
        return None
    missing = [flag for flag, v in (("--tls-cert/--tls-key", certfile),
                                    ("--token-file", token)) if not v]
    if missing:
        return (f"the dashboard listens on {host}, beyond this host, only over HTTPS with a "
                f"bearer token: give {' and '.join(missing)} (or bind 127.0.0.1 and reach it "
                f"through an SSH tunnel)")
    return None


def _asset(name: str) -> bytes:
    return resources.files("ops.tools").joinpath(name).read_bytes()


def make_app(board: Board, token: str | None = None, host: str = "127.0.0.1"):
    """The Starlette application over `board` (polled elsewhere). Listening on loopback, it
    answers only requests that name a loopback host (a web page whose name an attacker
    points at 127.0.0.1 cannot read the run)."""
    try:
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.middleware.trustedhost import TrustedHostMiddleware
        from starlette.responses import Response
        from starlette.routing import Route
    except ImportError as e:
        raise ValueError(DASHBOARD_EXTRA) from e
    page, script = _asset("dashboard.html"), _asset("dashboard.js")

    def index(request):
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

    def js(request):
        return Response(script, media_type="text/javascript; charset=utf-8", headers=HEADERS)

    def state(request):
        if token is not None:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                return Response(b'{"error": "a bearer token is needed"}', status_code=401,
                                media_type="application/json",
                                headers={**HEADERS, "WWW-Authenticate": "Bearer"})
        body = json.dumps(board.state(), allow_nan=False, separators=(",", ":"))
        return Response(body, media_type="application/json", headers=HEADERS)

    hosts = (["127.0.0.1", "localhost", "::1", "[::1]", host] if loopback_host(host)
             else ["*"])  # beyond loopback the token guards the data
    return Starlette(routes=[Route("/", index), Route("/dashboard.js", js),
                             Route("/api/state", state)],
                     middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)])


def serve(board: Board, *, host: str, port: int, interval_s: float = 1.0,
          certfile: str | None = None, keyfile: str | None = None,
          token: str | None = None) -> None:
    """Read the run every `interval_s` and serve the page until interrupted."""
    problem = check_bind(host, certfile=certfile, keyfile=keyfile, token=token)
    if problem:
        raise ValueError(problem)
    try:
        import uvicorn
    except ImportError as e:
        raise ValueError(DASHBOARD_EXTRA) from e
    app = make_app(board, token, host)
    for f in (certfile, keyfile):
        if f and not Path(f).is_file():
            raise ValueError(f"{f}: no such file")
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                board.poll()
            except Exception as e:  # noqa: BLE001 (the page says why; the reader goes on)
                log.exception("dashboard: reading the run failed")
                board.error = f"{type(e).__name__}: {str(e)[:200]}"
            stop.wait(interval_s)

    board.poll()
    reader = threading.Thread(target=loop, name="dashboard-reader", daemon=True)
    reader.start()
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                    ssl_certfile=certfile, ssl_keyfile=keyfile, server_header=False)
    finally:
        stop.set()
        reader.join(timeout=5)
