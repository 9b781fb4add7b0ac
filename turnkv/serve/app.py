"""The FastAPI app: OpenAI routes on top of the scheduler, plus /health, /metrics and /flush_cache.

Routes read the body themselves (size cap, strict UTF-8, JSON) so that every bad input gets an
OpenAI-style error with a precise message rather than a framework default.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from turnkv.errors import InvalidRequestError
from turnkv.methods.recipe import Recipe
from turnkv.serve import chat as chat_requests
from turnkv.serve import protocol, warmup
from turnkv.serve.config import ServeConfig
from turnkv.serve.errors import APIError, from_engine, install_handlers, validation_error
from turnkv.serve.job import Job, Outcome, check_max_tokens
from turnkv.serve.metrics import Metrics
from turnkv.serve.scheduler import Scheduler
from turnkv.serve.store import ConversationStore, TierHook
from turnkv.serve.engine_ops import EngineOps
from turnkv.serve.tier_hook import StateTierHook
from turnkv.serve.token_bytes import CompletionText, TokenBytes

log = logging.getLogger("turnkv.serve")

SESSION_HEADER = "x-session-id"
MAX_JSON_DEPTH = 64  # arrays and objects inside one another in a request body
MAX_SESSION_ID = 256


def create_app(llm, config: ServeConfig | None = None, tiers: TierHook | str | None = "state",
               idle_ttl_s: float | None = None) -> FastAPI:
    """The app over `llm`. tiers: where idle conversations go when the KV pool fills: "state" (the
    engine's CPU and disk tiers, `llm.state`; conversations a server left in its disk directory are
    taken back now), another TierHook, or None (they are dropped)."""
    config = config or ServeConfig()
    model_name = config.served_model_name or llm.name
    metrics = Metrics(model_name)
    if tiers == "state":
        tiers = StateTierHook(llm.state, on_traffic=metrics.count_traffic) if config.reuse else None
        if tiers is not None and config.background_packs and llm.state.packer is None:
            # The scheduler's worker lands the packs (store.settle); under tensor parallelism every rank
            # packs in the background (ops.start).
            llm.state.pack_in_background(resident=config.resident_packs)
    ops = EngineOps(llm, tiers)
    # With the engine's tiers, every rank calibrates the restore costs now, not at the first turn's end,
    # where the running streams would wait.
    ops.start(llm.recipe, calibrate=isinstance(tiers, StateTierHook))
    store = ConversationStore(llm, reuse=config.reuse, idle_ttl_s=idle_ttl_s, ops=ops,
                              on_evict=lambda how: metrics.labels(metrics.evictions, how).inc())
    adopted = store.adopt()
    if adopted:
        log.info("took back %d conversations from the disk tier", adopted)
    scheduler = Scheduler(llm, store, config, metrics)
    metrics.bind(llm, scheduler, store)
    recipes = Recipes(llm.recipe, config.head_patterns, check=llm.resolve_recipe)
    vocab = TokenBytes(llm.tokenizer)  # each token's bytes and text, for logprobs

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        if warmup.wanted(config.warmup, llm):
            if isinstance(tiers, StateTierHook):
                await asyncio.to_thread(tiers.reserve)
            app.state.warmup = await asyncio.to_thread(warmup.warm_up, scheduler, recipes)
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop, config.drain_timeout_s)
            if isinstance(tiers, StateTierHook):
                try:  # the engine outlives the app: its later turns pack where they end, on every rank
                    await asyncio.to_thread(ops.pack_inline)
                except Exception:  # a tensor-parallel engine that broke: nothing left to pack
                    log.exception("could not take the packs in flight")

    app = FastAPI(title="turnkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.store, app.state.metrics, app.state.config = scheduler, store, metrics, config
    install_handlers(app)

    async def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or wrong API key; send the header Authorization: Bearer <key>",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return JSONResponse({"status": "unavailable", "reason": "worker stopped"}, status_code=503)
        broken = ops.unavailable()
        if broken is not None:
            return JSONResponse({"status": "unavailable", "reason": broken}, status_code=503)
        if not scheduler.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache", dependencies=[Depends(require_key)])
    async def flush_cache():
        """Free what the server keeps between requests, as SGLang's endpoint of the same name does:
        every idle conversation (in every tier) and the prefix index. Running requests go on."""
        conversations, prefixes = await asyncio.to_thread(scheduler.flush)
        return {"flushed": conversations, "prefix_entries_flushed": prefixes}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [protocol.model_card(model_name, llm.max_model_len)]}

    def common(req: protocol.SamplingRequest) -> tuple[Recipe, str, int | None]:
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")
        refused = req.refused_field()
        if refused is not None:
            raise APIError(400, f"{refused} is not supported by this server", param=refused, code="unsupported_field")
        try:
            recipe, key = recipes.resolve(req.recipe)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="recipe", code="invalid_recipe") from None
        try:
            max_tokens = check_max_tokens(req.requested_max_tokens(), llm.max_model_len, req.max_tokens_field)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=req.max_tokens_field) from None
        try:
            llm.turn_parts.sampling_params(**req.sampling())  # bad sampling values fail here, before queueing
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=req.sampling_field(str(e))) from None
        return recipe, key, max_tokens

    async def submit(request: Request, req, **inputs) -> tuple[Stream, Job]:
        recipe, key, max_tokens = common(req)
        stream = Stream(asyncio.get_running_loop())
        job = Job(stream.push, req.sampling(), max_tokens, config.default_max_tokens, recipe, key,
                  fields=(req.prompt_field, req.max_tokens_field), **inputs)
        scheduler.submit(job)
        try:
            first = await stream.next(request)
        except (ClientGone, asyncio.CancelledError):
            scheduler.cancel(job)
            raise
        if first[0] == "error":
            raise from_engine(first[1], config.retry_after_s, job.prompt_field)
        return stream, job

    @v1.post("/chat/completions")
    async def chat(request: Request):
        req = await read_request(request, protocol.ChatCompletionRequest, config.max_body_bytes)
        session = session_id(request)
        try:  # rendering and grammar: off the loop and the worker
            plan = await asyncio.to_thread(chat_requests.plan, llm, req)
        except InvalidRequestError as e:  # the engine cannot take chat messages at all (no tokenizer)
            raise APIError(400, str(e), param="messages") from None
        stream, job = await submit(request, req, messages=plan.messages, session=session, rendered=plan.rendered,
                                   grammar=plan.grammar)
        rid, created = protocol.new_id("chatcmpl"), int(time.time())
        headers = {"X-Session-Id": session} if session else {}
        if req.stream:
            reply = chat_requests.StreamedReply(plan)

            def chunk(delta=None, finish=None, usage=None, choices=True):
                body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                        "choices": [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]
                        if choices else []}
                if req.include_usage:
                    body["usage"] = usage
                return body

            def text_chunk(delta):
                content = reply.content(delta.text)
                if not content and not (req.logprobs and delta.logprobs):
                    return None
                body = chunk({"content": content})
                if req.logprobs:
                    body["choices"][0]["logprobs"] = protocol.chat_logprobs(vocab, delta.logprobs)
                return body

            def closing(o):
                deltas, finish_reason = reply.closing(o.finish_reason)
                return [chunk(d) for d in deltas] + [chunk(finish=finish_reason)] + (
                    [chunk(usage=usage_of(o), choices=False)] if req.include_usage else [])

            return sse(scheduler, job, stream, chunk({"role": "assistant", "content": ""}), text_chunk, closing,
                       headers)
        outcome = await finish(request, scheduler, job, stream)
        message, finish_reason = chat_requests.message(plan, outcome.text, outcome.finish_reason)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": message,
                         "logprobs": None if outcome.logprobs is None else
                         protocol.chat_logprobs(vocab, outcome.logprobs),
                         "finish_reason": finish_reason}],
            "usage": usage_of(outcome)}, headers=headers)

    @v1.post("/completions")
    async def completions(request: Request):
        req = await read_request(request, protocol.CompletionRequest, config.max_body_bytes)
        stream, job = await submit(request, req, prompt=req.prompt)
        rid, created = protocol.new_id("cmpl"), int(time.time())

        def chunk(text="", finish=None, usage=None, choices=True):
            body = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
                    if choices else []}
            if req.stream and req.include_usage:
                body["usage"] = usage
            return body

        pieces = CompletionText(llm.tokenizer)  # each token's piece of the text, across a stream's chunks
        if req.stream:
            def text_chunk(delta):
                body = chunk(delta.text)
                if req.logprobs is not None:
                    body["choices"][0]["logprobs"] = protocol.completion_logprobs(vocab, delta.logprobs, pieces)
                return body

            return sse(scheduler, job, stream, None, text_chunk,
                       lambda o: [chunk(finish=o.finish_reason)] + (
                           [chunk(usage=usage_of(o), choices=False)] if req.include_usage else []), {})
        outcome = await finish(request, scheduler, job, stream)
        body = chunk(outcome.text, outcome.finish_reason)
        if outcome.logprobs is not None:
            body["choices"][0]["logprobs"] = protocol.completion_logprobs(vocab, outcome.logprobs, pieces,
                                                                          outcome.text)
        body["usage"] = usage_of(outcome)
        return JSONResponse(body)

    app.include_router(v1)
    return app


class Recipes:
    """Request recipes, parsed once per distinct string. Only recipe strings, and a file-valued
    parameter only by a name the operator gave (`named`, --head-pattern NAME=PATH): an HTTP request
    never makes the server read a file it names, nor learn whether one exists."""

    def __init__(self, default: Recipe, named: dict[str, str] | None = None, check=None):
        """check: called on each parsed recipe; raises InvalidRequestError for one the engine cannot
        run (LLM.resolve_recipe: a kv_dtype its pool does not hold)."""
        self.default, self.named = default, dict(named or {})
        self.check = check or (lambda recipe: recipe)
        self.cache: dict[str, tuple[Recipe, str]] = {}

    def resolve(self, text: str | None) -> tuple[Recipe, str]:
        if text is None:
            return self.default, str(self.default)
        if text not in self.cache:
            if "/" in text or "\\" in text or text.strip().endswith((".json", ".yaml", ".yml")):
                raise InvalidRequestError("recipe files are not accepted over HTTP; send the recipe string")
            try:
                recipe = Recipe.parse(text).with_named_files(self.named)
                self.check(recipe)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"recipe: {e}") from None
            self.cache[text] = (recipe, str(recipe))
        return self.cache[text]


# ---- request reading ----------------------------------------------------------------------------------
async def read_request(request: Request, model, limit: int):
    """The body as a `model`: read on the event loop, decoded and validated in a thread (a large
    body takes tens of milliseconds to parse, which would delay every stream's next event)."""
    body = await read_body(request, limit)
    return await asyncio.to_thread(lambda: parse(model, decode_json(body)))


async def read_body(request: Request, limit: int) -> bytearray:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
    return body


def decode_json(body: bytearray) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8") from None
    too_deep = APIError(400, f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                        code="invalid_json")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise too_deep from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise too_deep
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def json_depth(value) -> int:
    """How deep arrays and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def parse(model, data: dict):
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    for name, value in data.items():  # lone surrogates are valid JSON escapes but no text: the tokenizer
        try:  # cannot take them
            json.dumps({name: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{name} contains a lone surrogate (\\ud800-\\udfff), not text",
                           param=name, code="invalid_utf8") from None
    return req


def session_id(request: Request) -> str | None:
    value = request.headers.get(SESSION_HEADER)
    if value is None:
        return None
    if not value or len(value) > MAX_SESSION_ID or not value.isprintable():
        raise APIError(400, f"{SESSION_HEADER} must be 1 to {MAX_SESSION_ID} printable characters",
                       param=SESSION_HEADER)
    return value


def usage_of(o: Outcome) -> dict:
    return protocol.usage(o.prompt_tokens, o.completion_tokens, o.cached_tokens)


# ---- the stream of one request's events ----------------------------------------------------------------
class ClientGone(APIError):
    """The client disconnected before its reply was ready (nginx's 499; nobody reads the response)."""

    def __init__(self):
        super().__init__(499, "the client closed the request", code="client_closed_request")


class Stream:
    """Events from the worker thread ("start", "text", "done", "error") delivered on the event loop."""

    POLL_S = 0.25  # how often a waiting request checks that its client is still there

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.ended = False
        self.checked_at = time.monotonic()

    def push(self, kind: str, payload) -> None:  # worker thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is gone (server stopped): nobody is listening
            pass

    async def next(self, request: Request | None = None):
        """The next event; with `request`, raises ClientGone once its client has disconnected (checked
        every POLL_S, also while events keep coming)."""
        getter = asyncio.ensure_future(self.queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=self.POLL_S)
                now = time.monotonic()
                if request is not None and now - self.checked_at >= self.POLL_S:
                    self.checked_at = now
                    if await request.is_disconnected():
                        raise ClientGone
                if done:
                    event = getter.result()
                    self.ended = event[0] in ("done", "error")
                    return event
        finally:
            getter.cancel()


async def finish(request: Request, scheduler: Scheduler, job: Job, stream: Stream) -> Outcome:
    """Wait for a non-streamed request's end; a client that leaves first frees its slot."""
    try:
        while True:
            kind, payload = await stream.next(request)
            if kind == "done":
                return payload
            if kind == "error":
                raise from_engine(payload, scheduler.config.retry_after_s, job.prompt_field)
    except (ClientGone, asyncio.CancelledError):
        scheduler.cancel(job)
        raise


def sse(scheduler: Scheduler, job: Job, stream: Stream, opening: dict | None, text_chunk, closing, headers: dict):
    """Server-sent events: `data: {json}` per chunk, then `data: [DONE]`. A client that disconnects
    closes the generator, and its request is cancelled."""

    def line(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def events():
        try:
            if opening is not None:
                yield line(opening)
            while True:
                kind, payload = await stream.next()
                if kind == "text":
                    body = text_chunk(payload)
                    if body is not None:
                        yield line(body)
                elif kind == "done":
                    for c in closing(payload):
                        yield line(c)
                    break
                elif kind == "error":  # headers are sent: the error travels in the stream
                    yield line(from_engine(payload, scheduler.config.retry_after_s, job.prompt_field).body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not stream.ended:
                scheduler.cancel(job)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **headers})
