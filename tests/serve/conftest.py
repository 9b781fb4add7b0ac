"""A turnkv server on a loopback port, in a thread of the test process, over the tiny chat model."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from turnkv.serve import ServeConfig, create_app


class RunningServer:
    def __init__(self, llm, config: ServeConfig, **app_options):
        self.llm = llm
        self.app = create_app(llm, config, **app_options)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    @property
    def scheduler(self):
        return self.app.state.scheduler

    @property
    def store(self):
        return self.app.state.store

    def client(self, **options):
        import openai

        options.setdefault("api_key", "unused")
        options.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", **options)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{labels}': value}."""
        import httpx

        text = httpx.get(self.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
            if base == name and all(found.get(k) == v for k, v in labels.items()):
                total += value
        return total


@contextlib.contextmanager
def running(llm, **config):
    app_options = {k: config.pop(k) for k in ("tiers", "idle_ttl_s") if k in config}
    with RunningServer(llm, ServeConfig(**config), **app_options) as server:
        yield server


@pytest.fixture(scope="module")
def serve_llm(chat_model_dir):
    """The tiny chat model with its own KV pool, so pool accounting is the server's alone."""
    import turnkv

    return turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB")


MODEL = "tiny"


@pytest.fixture(scope="module")
def server(serve_llm):
    with running(serve_llm, served_model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def long_llm(tmp_path_factory, smol_tokenizer):
    """The tiny chat model with an 8K context, for requests that must run long enough to interrupt."""
    import turnkv
    from tests.conftest import save_tiny

    path = tmp_path_factory.mktemp("tiny-long")
    save_tiny(path, "llama", vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer, max_position_embeddings=8192)
    return turnkv.LLM(str(path), device="cpu", kv_memory="32MiB")


def wait_for(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def stream_in_background(url: str, body: dict, headers: dict | None = None, timeout: float = 120):
    """POST a streamed request on a thread; -> (thread, lines, started): the non-empty SSE lines as
    they arrive, and an event set by the first one."""
    lines, started = [], threading.Event()

    def consume():
        with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    return reader, lines, started


@contextlib.contextmanager
def local_ray_serve(app):
    """A local Ray instance (2 CPUs) serving the application app() builds at / on a free loopback port;
    yields its URL. Ray is imported here: tests that use it skip without the ray extra."""
    import os

    import ray
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # On a loaded 2-core machine the proxy can take longer than Ray Serve's 5 s ready check, and the
    # controller then kills it before it runs: give its checks a minute.
    patience = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
    env = {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", **patience}
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", **patience})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(), name="turnkv", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
