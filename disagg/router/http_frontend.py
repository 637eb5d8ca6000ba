"""The OpenAI-compatible HTTP API: `POST /v1/completions`, `POST /v1/chat/completions` (whole, or
streamed as server-sent events ending with `data: [DONE]`), `GET /v1/models`, `GET /health`.

It is served by aiohttp, in the process and on the event loop of the gRPC frontend: aiohttp is
asyncio-native, so it runs on the loop grpc.aio already uses and both APIs share one request
path (disagg.router.request_path: admission bound, validation, placement, metrics, records) with
no thread hand-off; it streams server-sent events with `StreamResponse`; and it is long
established and well maintained. Neither API calls the other.

A failure answers with the HTTP status of the gRPC code it maps to (disagg.errors.http_status),
in OpenAI's error shape: bad input 400, missing or wrong key 401, unknown model 404, refused by
admission 429 with Retry-After, draining or no instance 503, the router's own bug 500. A client
that disconnects cancels its request: its blocks are freed on every instance, as when a gRPC
stream is cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from disagg.config import ServingConfig
from disagg.errors import DisaggError, InvalidRequestError, http_status
from disagg.router.directory import InstanceDirectory
from disagg.router.health import HealthVerdict
from disagg.router.openai_requests import ApiRequest, choice_params, parse_chat, parse_completion
from disagg.router.openai_responses import Answer, error_body, invalid_request_body
from disagg.router.request_path import RequestFailed, RequestPath
from disagg.router.stream_stats import Outcome
from disagg.router.validation import MAX_CHARS_PER_TOKEN, max_tokens_that_fit
from disagg.rpc.messages import TokenDelta

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # a refusal reflects the load of this moment; a second later the batches have moved on
MiB = 1 << 20
# Connections the kernel holds for us before we accept them (aiohttp's default: 128). A flood opens
# hundreds at once; past the backlog the kernel drops their SYNs and each client tries again a
# second later, so its 429 takes a second more (issue 40). The kernel caps it at somaxconn.
LISTEN_BACKLOG = 4096

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
GENERATIONS = frozenset((COMPLETIONS, CHAT_COMPLETIONS))

Emit = Callable[[int, TokenDelta, "Outcome | None"], Awaitable[None]]


class HttpFrontend:
    def __init__(
        self, path: RequestPath, directory: InstanceDirectory, config: ServingConfig, model_name: str,
        verdict: HealthVerdict | None = None,
    ):  # fmt: skip
        """`verdict`: the server's health loop's (disagg.router.health); None: the pools alone."""
        self.path = path
        self.verdict = verdict
        self.directory = directory
        self.config = config
        self.model_name = model_name
        self.started = int(time.time())
        self.address: str | None = None  # HOST:PORT, once started
        self._runner: web.AppRunner | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> str:
        """Listen on the config's http_host and http_port (TLS as gRPC's); the address, HOST:PORT."""
        config = self.config
        ssl_context = _ssl_context(config)
        # Cancelling the handler of a client that went away is what ends its request on the workers.
        # At stop, the drain has ended every request: what is left gets gRPC's grace, a second.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, config.http_host, config.http_port, ssl_context=ssl_context, backlog=LISTEN_BACKLOG
        )
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        self.address = f"{config.http_host}:{self._runner.addresses[0][1]}"
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def app(self) -> web.Application:
        # Room for the longest text the request path reads before refusing it as too long.
        limits = self.path.limits
        app = web.Application(
            client_max_size=limits.max_model_len * MAX_CHARS_PER_TOKEN * 4 + MiB, middlewares=[self._door]
        )
        app.router.add_post(COMPLETIONS, self.completions)
        app.router.add_post(CHAT_COMPLETIONS, self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    # ---- the door ------------------------------------------------------------------------------------
    @web.middleware
    async def _door(self, request: web.Request, handler) -> web.StreamResponse:
        """A generation over the in-flight bound (or while draining) is refused here, as soon as
        aiohttp has its headers: before its body is read or parsed, and before the handler's
        first await, so that a flood's refusals do not wait behind the admitted requests' work.
        Every generation is told to the request path as it arrives (a burst's admitted requests
        wait for it to pass: disagg.router.arrivals). The handler checks the bound again, for
        its n choices."""
        if request.path not in GENERATIONS or request.method != "POST":
            return await handler(request)
        self.path.arrived()
        if not self._authorized(request):
            return _unauthorized()
        try:
            self.path.admit(1)
        except DisaggError as exc:
            return _failure(exc.grpc_code_name, str(exc))
        return await handler(request)

    # ---- endpoints -----------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _unauthorized()
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "disagg",
            "max_model_len": self.path.limits.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving, every pool has an instance in placement and the controller lives
        (as gRPC's health: disagg.router.health). Behind the API key like the rest, unless
        `health_without_key` opens it for probes."""
        if not self.config.health_without_key and not self._authorized(request):
            return _unauthorized()
        judged_ill = self.verdict is not None and self.verdict.problem is not None
        pools_served = all(self.directory.healthy(role) for role, _ in self.config.pools())
        serving = not self.path.draining and pools_served and not judged_ill
        return web.json_response({"status": "ok" if serving else "unavailable"}, status=200 if serving else 503)

    # ---- a generation ----------------------------------------------------------------------------------
    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        received_at = time.monotonic()  # the client's TTFT starts about here, as for gRPC
        if not self._authorized(request):
            return _unauthorized()
        try:
            api = parse(await _json_body(request), self.model_name)
        except InvalidRequestError as exc:
            self.path.metrics.observe_failure(exc.grpc_code_name)
            return _invalid(exc)
        request_ids = [f"http-{uuid.uuid4().hex}" for _ in range(api.n)]
        try:
            self.path.admit(api.n)
            for request_id in request_ids:  # no await since admit(): the bound holds
                self.path.claim(request_id)
            return await self._run(request, api, request_ids, received_at)
        except InvalidRequestError as exc:
            return _invalid(exc)
        except DisaggError as exc:
            return _failure(exc.grpc_code_name, str(exc))
        except RequestFailed as exc:
            return _failure(exc.code, exc.message)
        except Exception as exc:  # the router's own bug: the client must not be told it sent garbage
            logger.exception("HTTP request failed inside the router")
            return _failure("INTERNAL", f"internal error: {type(exc).__name__}: {exc}")
        finally:
            for request_id in request_ids:  # those that never started a stream
                self.path.release(request_id)

    async def _run(self, request: web.Request, api: ApiRequest, request_ids: list[str], received_at: float):
        prompt_ids, params = await self.path.prepare(api.generate)
        if api.fill_context:
            params = dataclasses.replace(params, max_tokens=max_tokens_that_fit(len(prompt_ids), self.path.limits))
        answer = Answer(api, self.model_name, self._token_text)

        async def run_choices(emit: Emit) -> None:
            demand = self.path.demand(api.generate)
            runs = [(i, request_id, choice_params(params, i)) for i, request_id in enumerate(request_ids)]
            await self._choices(runs, prompt_ids, demand, received_at, _gone(request), emit)

        if api.stream:
            return await _stream(request, answer, run_choices)

        async def add(index: int, delta: TokenDelta, outcome: Outcome | None) -> None:
            answer.add(index, delta, outcome)

        await run_choices(add)
        return web.json_response(answer.whole())

    async def _choices(self, runs, prompt_ids, demand, received_at, client_gone, emit: Emit) -> None:
        """Every choice through the request path at once, their deltas to `emit` as they come.
        The first failure ends them all (RequestFailed); so does this task's cancel (the client
        went away), and each frees its blocks."""
        queue: asyncio.Queue = asyncio.Queue()

        async def choice(index: int, request_id: str, params) -> None:
            deltas = self.path.stream(request_id, prompt_ids, params, demand, received_at, client_gone)
            try:
                async for delta, outcome in deltas:
                    queue.put_nowait((index, delta, outcome))
                queue.put_nowait(None)  # this choice is done
            except RequestFailed as exc:
                queue.put_nowait(exc)
            finally:
                await deltas.aclose()

        tasks = [asyncio.create_task(choice(*run)) for run in runs]
        try:
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if isinstance(item, RequestFailed):
                    raise item
                if item is None:
                    done += 1
                else:
                    await emit(*item)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.path.tokenizer
        if tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's spelling, for a model without a tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return self.path.authorized(token.strip() if scheme.lower() == "bearer" else "")


async def _stream(request: web.Request, answer: Answer, run_choices) -> web.StreamResponse:
    """The answer as server-sent events. The headers go out with the first event, so that a request
    refused before its first token (admission, placement) still gets its status."""
    events = _EventStream(request)

    async def send_chunk(index: int, delta: TokenDelta, outcome: Outcome | None) -> None:
        chunk = answer.chunk(index, delta, outcome)
        if chunk is not None:
            await events.send(chunk)

    try:
        await run_choices(send_chunk)
    except RequestFailed as exc:
        if events.response is None:
            return _failure(exc.code, exc.message)
        await events.send(error_body(exc.code, exc.message))  # mid-stream: the OpenAI SDK raises it
        return await events.close()
    except ConnectionResetError:  # the client went away while we wrote: the choices are cancelled
        return events.response or web.Response(status=499)
    if answer.api.include_usage:
        await events.send(answer.usage_chunk())
    return await events.close()


class _EventStream:
    """Server-sent events (`data: {...}` blank line), opened by the first."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response: web.StreamResponse | None = None

    async def send(self, event: dict | str) -> None:
        if self.response is None:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.response.prepare(self.request)
        data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode())

    async def close(self) -> web.StreamResponse:
        await self.send("[DONE]")
        await self.response.write_eof()
        return self.response


async def _json_body(request: web.Request):
    try:
        return json.loads(await request.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError("body", f"not valid JSON: {exc}") from None


def _gone(request: web.Request) -> Callable[[], bool]:
    def client_gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return client_gone


def _invalid(exc: InvalidRequestError) -> web.Response:
    return web.json_response(invalid_request_body(exc), status=http_status(exc.grpc_code_name))


def _failure(code: str, message: str) -> web.Response:
    status = http_status(code)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return web.json_response(error_body(code, message), status=status, headers=headers)


def _unauthorized() -> web.Response:
    body = error_body("UNAUTHENTICATED", "missing or wrong API key (send Authorization: Bearer <key>)")
    return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})


def _ssl_context(config: ServingConfig) -> ssl.SSLContext | None:
    """The gRPC port's certificate and key (tls_cert_file, tls_key_file), and its demand for
    client certificates (tls_client_ca_file); or None: plain HTTP."""
    if not config.tls_cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    if config.tls_client_ca_file:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=config.tls_client_ca_file)
    return context
