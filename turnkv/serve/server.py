"""Running the app under uvicorn, with a graceful drain on SIGTERM/SIGINT: /health turns 503 at once
(so a router stops sending), new requests get 503 while the listener stays open, admitted ones finish,
then the listener closes, idle conversations go to the disk tier (when the engine has one: a server
started over the same directory continues them), and the process exits 0."""

from __future__ import annotations

import errno
import ipaddress
import logging
import signal
import socket
import threading

import uvicorn

from turnkv.errors import InvalidRequestError
from turnkv.serve.app import create_app
from turnkv.serve.config import ServeConfig

log = logging.getLogger("turnkv.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain: the first SIGTERM/SIGINT turns /health and new requests to 503 while the
    listener stays open and running requests finish (up to the scheduler's drain timeout); only then
    does uvicorn close the listener and shut down. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, scheduler, drain_timeout_s: float):
        super().__init__(config)
        self.scheduler, self.drain_timeout_s = scheduler, drain_timeout_s
        self.draining: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.draining is not None:  # a second signal: stop now
            self._exit(sig, frame)
            return
        self.scheduler.begin_drain()
        self.draining = threading.Thread(target=self._drain, args=(sig, frame), name="turnkv-drain", daemon=True)
        self.draining.start()

    def _drain(self, sig, frame) -> None:
        self.scheduler.wait_idle(self.drain_timeout_s)
        self._exit(sig, frame)

    def _exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once it has shut down; after a completed drain SIGTERM is the
        # normal way to stop, so the process exits 0 instead of "killed by SIGTERM".
        captured = getattr(self, "_captured_signals", None)
        if captured is not None and sig == signal.SIGTERM and sig in captured:
            captured.remove(sig)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) as uvicorn binds one (SO_REUSEADDR, IPv6 for an address
    with a colon), for serve(listener=...); InvalidRequestError naming the port when it is in use or
    the address cannot be bound. `turnkv serve` binds it before the model loads."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise InvalidRequestError(f"port {port} on {host} is already in use (another server?); stop it or "
                                      f"choose another with --port") from None
        raise InvalidRequestError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def startup_summary(llm, config: ServeConfig) -> str:
    """One line on what a server serves and where: model, device, dtype, KV pool, recipe, address."""
    info = llm.info()
    kv = "" if info["kv_dtype"] == "none" else f", KV {info['kv_dtype']}"
    name = llm.name if config.served_model_name in (None, llm.name) else f"{config.served_model_name} ({llm.name})"
    return (f"serving {name} on {info['device']}, {info['dtype']}{kv}; KV pool "
            f"{info['kv_pool_bytes'] / 2**20:,.0f} MiB = {info['kv_pool_tokens']:,} tokens of full KV; "
            f"recipe: {llm.recipe}; at http://{config.host}:{config.port}/v1")


def serve(llm, config: ServeConfig, idle_ttl_s: float | None = None, log_level: str = "info",
          tiers="state", listener: socket.socket | None = None) -> None:
    """Run the app until a signal drains it. listener: a socket from bind_listener to serve on (else
    uvicorn binds config.host and config.port itself)."""
    app = create_app(llm, config, tiers=tiers, idle_ttl_s=idle_ttl_s)
    log.info("%s", startup_summary(llm, config))
    if not is_loopback(config.host) and config.api_key is None:
        log.warning("listening on %s without an API key: anyone who reaches this address can use the model",
                    config.host)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                        timeout_graceful_shutdown=int(config.drain_timeout_s))
    server = DrainingServer(uv, app.state.scheduler, config.drain_timeout_s)
    if listener is None:
        server.run()
    else:
        server.run(sockets=[listener])
