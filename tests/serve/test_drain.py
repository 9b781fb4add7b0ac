"""The drain (turnkv serve's SIGTERM): /health and new requests get 503 while the listener stays open
and running streams finish; the listener closes last."""

from __future__ import annotations

import json
import signal
import socket
import threading

import httpx
import uvicorn

from tests.serve.conftest import MODEL, stream_in_background, wait_for
from tests.serve.test_errors import CHAT, HELLO, assert_error
from turnkv.serve import ServeConfig, create_app
from turnkv.serve.server import DrainingServer


def test_during_the_drain_health_and_new_requests_get_503_and_the_listener_closes_last(long_llm):
    config = ServeConfig(served_model_name=MODEL, drain_timeout_s=60)
    app = create_app(long_llm, config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = DrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=60),
                            app.state.scheduler, config.drain_timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "the server to start")

    body = {"model": MODEL, "messages": HELLO, "max_tokens": 300, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    mid_drain = {}
    reader, lines, started = stream_in_background(url + CHAT, body)
    assert started.wait(30)
    server.handle_exit(signal.SIGTERM, None)
    # The stream is still running: the listener answers, with 503s.
    health = httpx.get(url + "/health", timeout=10)
    mid_drain["running"] = app.state.scheduler.num_running
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    refused = httpx.post(url + CHAT, json={"model": MODEL, "messages": HELLO, "max_tokens": 2}, timeout=10)
    assert_error(refused, 503, "draining")
    assert refused.headers["Retry-After"] == "1"
    assert mid_drain["running"] == 1
    reader.join(120)
    thread.join(60)
    assert not thread.is_alive()
    # The stream that was running finished whole; then the listener closed.
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 300
    try:
        httpx.get(url + "/health", timeout=2)
        raise AssertionError("the listener is still open")
    except httpx.TransportError:
        pass
    sock.close()
