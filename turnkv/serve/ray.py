"""turnkv on Ray Serve: one engine per replica, and an ingress that sends each conversation to one
replica, where its KV lives (`pip install 'turnkv[ray]'`).

build_app(model, num_replicas, llm_options, config) -> a Ray Serve application. The ingress (`Router`)
keys a request by its X-Session-Id header, else by a hash of the messages up to the first user message;
`SessionAffinityRouter` maps keys to live replicas by rendezvous hashing; each replica (`Engine`) runs
the app of `turnkv serve` in-process, with its own state_disk_dir subdirectory by replica rank.
Design and usage: docs/serving.md#ray-serve"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import RequestRouter
except ImportError as e:  # an optional extra: the rest of turnkv never imports this module
    raise ImportError("turnkv.serve.ray needs Ray Serve: pip install 'turnkv[ray]' (or 'ray[serve]')") from e

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from turnkv.engine.llm import LLM
from turnkv.serve.app import SESSION_HEADER, create_app
from turnkv.serve.config import ServeConfig

ROUTING_KEY = "session_key"  # the keyword of Engine.forward that SessionAffinityRouter reads
REPLICA_HEADER = "x-turnkv-replica"  # on every response: the engine replica that served it
HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}  # the proxy's own framing decides these


# ---- routing ----------------------------------------------------------------------------------------
def routing_key(session: str | None, body: bytes) -> str | None:
    """What keeps a conversation on one replica: its session header, else its opening messages (chat)
    or its prompt's opening (completions); None for a request that names no conversation."""
    if session:
        return "session:" + session
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    messages = data.get("messages")
    if isinstance(messages, list) and messages:
        opening = []
        for m in messages:
            opening.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
        return "chat:" + _digest(json.dumps(opening, sort_keys=True))
    prompt = data.get("prompt")
    if isinstance(prompt, str) and prompt:
        return "prompt:" + _digest(prompt[:1024])
    return None


def rendezvous(key: str, replicas: list[str]) -> str:
    """The replica `key` belongs to: the highest hash of (replica, key). Adding or removing a replica
    moves only the keys that it wins or held."""
    return max(replicas, key=lambda r: hashlib.sha256(f"{r}\0{key}".encode()).digest())


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class SessionAffinityRouter(RequestRouter):
    """Ray Serve request router for Engine: a request with a routing key goes to that key's replica
    only (it waits there rather than run where the conversation's KV is not); one without goes to any."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        key = pending_request.kwargs.get(ROUTING_KEY) if pending_request is not None else None
        if key is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rendezvous(key, list(by_id))]]]


# ---- the engine replica -------------------------------------------------------------------------------
class Engine:
    """One LLM and its OpenAI app. The app's start-up and shutdown (the drain that writes idle
    conversations to the disk tier) run around the replica's life. (Not a Ray ingress itself: Ray
    allows one per application, and that is the Router.)"""

    async def __init__(self, model: str | None = None, llm_options: dict | None = None, config: dict | None = None):
        options = dict(llm_options or {})
        if options.get("state_disk_dir"):  # replicas must not share a directory
            rank = serve.get_replica_context().rank
            rank = getattr(rank, "rank", rank)
            options["state_disk_dir"] = os.path.join(options["state_disk_dir"], f"replica-{rank}")
        self.llm = LLM(model, **options)
        self.app = create_app(self.llm, ServeConfig(**(config or {})))
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()

    async def __del__(self):
        if getattr(self, "lifespan", None) is not None:  # not when __init__ failed before it
            await self.lifespan.__aexit__(None, None, None)

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes, session_key=None):
        """One HTTP request run through this replica's app: yields (status, headers), then the body's
        chunks as the app sends them (a streamed reply stays a stream)."""
        replica = serve.get_replica_context().replica_id.unique_id
        async for event in asgi_request(self.app, method, path, query, headers, body):
            if isinstance(event, tuple):  # the response start: say which replica served it
                event = (event[0], [*event[1], (REPLICA_HEADER, replica)])
            yield event


async def asgi_request(app, method: str, path: str, query: bytes, headers: list, body: bytes):
    """Call an ASGI app in this process. Closing the generator early tells the app that the client
    disconnected (it then frees the request's slot, as for a client of `turnkv serve`)."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    pending = [body]

    async def receive():
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    task = asyncio.ensure_future(app(scope, receive, sent.put))
    try:
        while True:
            get = asyncio.ensure_future(sent.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the app returned (or failed) without finishing its response
                get.cancel()
                task.result()
                return
            message = get.result()
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    return
    finally:
        gone.set()
        try:
            await asyncio.wait_for(task, 10)
        except Exception:  # the app's own error handling has answered or logged it
            pass


# ---- the ingress --------------------------------------------------------------------------------------
class Router:
    """The HTTP ingress: reads a request, keys it, and streams it through the key's Engine replica."""

    def __init__(self, engine, max_body_bytes: int = ServeConfig.max_body_bytes):
        self.engine, self.max_body_bytes = engine, max_body_bytes

    def __serve_build_asgi_app__(self):
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def route(request: Request, path: str):
            body = bytearray()
            async for piece in request.stream():
                body += piece
                if len(body) > self.max_body_bytes:  # the engine would refuse it too; do not buffer it all
                    message = f"the request body exceeds the limit of {self.max_body_bytes} bytes"
                    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                                   "code": "body_too_large"}}, status_code=413)
            key = routing_key(request.headers.get(SESSION_HEADER), bytes(body))
            events = self.engine.options(stream=True).forward.remote(
                request.method, request.url.path, request.url.query.encode(), list(request.headers.items()),
                bytes(body), **{ROUTING_KEY: key})
            status, headers = await events.__anext__()

            async def rest():
                try:
                    async for chunk in events:
                        yield chunk
                finally:  # the client left (or the reply ended): stop the replica's side too
                    events.cancel()

            return StreamingResponse(rest(), status_code=status,
                                     headers={k: v for k, v in headers if k.lower() not in HOP_BY_HOP})

        return app


def replica_resources(llm_options: dict, actor_options: dict) -> dict:
    """The engine actor's Ray options. A replica with tensor_parallel N is one tensor-parallel group:
    rank 0 runs in the replica's actor and starts the other N - 1 ranks as its own processes, which
    inherit the GPUs Ray gave the actor (CUDA_VISIBLE_DEVICES). So on a GPU it asks Ray for N of them,
    unless num_gpus is given."""
    size = int(llm_options.get("tensor_parallel", 1))
    on_cpu = str(llm_options.get("device", "")).startswith("cpu")
    if size > 1 and not on_cpu and "num_gpus" not in actor_options:
        return {**actor_options, "num_gpus": size}
    return dict(actor_options)


def build_app(model: str | None = None, num_replicas: int = 1, llm_options: dict | None = None,
              config: dict | None = None, engine_actor_options: dict | None = None,
              router_actor_options: dict | None = None):
    """The Ray Serve application: Router (HTTP ingress) over `num_replicas` Engine replicas.
    llm_options go to turnkv.LLM (kv_memory, recipe, state_cpu_memory, state_disk_dir, tensor_parallel,
    ...), config to ServeConfig (api_key, max_running, ...; host and port are Ray's); *_actor_options
    to Ray (num_gpus, num_cpus, ...; with tensor_parallel N, a replica asks for N GPUs by default:
    replica_resources)."""
    config = dict(config or {})
    engine = serve.deployment(Engine).options(
        name="turnkv-engine", num_replicas=num_replicas,
        ray_actor_options=replica_resources(llm_options or {}, engine_actor_options or {}),
        # Above the engine's own limits: it answers 429 itself, so a session's requests never leave
        # its replica because Ray's queue there is full.
        max_ongoing_requests=config.get("max_running", 32) + config.get("max_waiting", 64) + 1,
        request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter))
    router = serve.deployment(serve.ingress()(Router)).options(
        name="turnkv-router", ray_actor_options=router_actor_options or {}, max_ongoing_requests=1000)
    return router.bind(engine.bind(model, llm_options, config),
                       config.get("max_body_bytes", ServeConfig.max_body_bytes))
