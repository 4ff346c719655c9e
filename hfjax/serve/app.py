"""The HTTP face of `hfjax serve`: the Tinker REST API (`/api/v1/...`) that the official `tinker` SDK speaks, over a
`ServeBackend`. `create_app` builds the FastAPI app; `hfjax.serve.http_server.ServerThread` (tests) or
`uvicorn.run` (`hfjax serve`) serves it. Routes are thin: `TinkerService` does the work, `hfjax.serve.wire` the
payloads. A refused request is answered with its status and `{"detail": message}`, which the SDK raises with the
message; a refused queued call fails its future (`{"error": message, "category": "user"}`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import fastapi
from fastapi import Depends, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from hfjax.serve import request_bodies as bodies
from hfjax.serve import wire
from hfjax.serve.backend import ServeBackend, ServeError
from hfjax.serve.registry import owner_of
from hfjax.serve.service import TinkerService

log = logging.getLogger(__name__)

POLL_SECONDS = 30.0
"""How long `/api/v1/retrieve_future` holds a request for a result before answering try_again (the SDK's read
timeout for it is 45 s)."""

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # plain API keys: no JWT exchange
    "parallel_fwdbwd_chunks": False,  # chunks of one forward_backward arrive in order
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,  # each future is polled on its own
    "custom_loss_server_side": False,  # forward_backward_custom runs its loss client-side
    "sample_join_sampling_session": True,
    "use_pyqwest_transport": False,  # httpx's own transport (the SDK's pyqwest one works as well)
}
"""`/api/v1/client/config`: the SDK's feature flags, set to the paths this server implements."""

DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": True}

UNSUPPORTED = {
    "/api/v1/create_custom_loss": "server-side custom losses are not supported (forward_backward_custom with a "
    "Python loss function runs it client-side)",
    "/api/v1/save_weights_external": "save_weights_external is not supported",
    "/api/v1/copy_weights": "copy_weights is not supported",
    "/api/v1/retrieve_futures": "retrieve_futures is not supported: poll /api/v1/retrieve_future",
    "/api/v1/auth/token": "JWT auth is not supported: send an API key",
}


def _owner(x_api_key: Annotated[str | None, Header()] = None) -> str:
    return owner_of(x_api_key)


Owner = Annotated[str, Depends(_owner)]
"""The caller, by its API key (the SDK sends it as X-API-Key): models and sessions are its own."""


def create_app(
    backend: ServeBackend, *, run_dir: str, tokenizer_id: str, poll_s: float = POLL_SECONDS
) -> fastapi.FastAPI:
    """The Tinker API over `backend`: training runs' metadata goes under `run_dir` (so a restarted server resumes
    from their checkpoint paths), and `get_info` names `tokenizer_id` (a local tokenizer directory) as the models'
    tokenizer, which also maps stop strings to token ids. `poll_s`: how long a retrieve_future call waits."""
    service = TinkerService(backend, run_dir=run_dir, tokenizer_id=tokenizer_id)

    @contextlib.asynccontextmanager
    async def lifespan(_: fastapi.FastAPI) -> AsyncIterator[None]:
        yield
        service.close()

    app = fastapi.FastAPI(title="hfjax serve (Tinker API)", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(ServeError)
    async def refused(_: Request, error: ServeError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc'][1:]) or 'body'}: {problem['msg']}"
            for problem in error.errors()
        )
        return JSONResponse({"detail": f"invalid request: {problems}"}, status_code=400)

    api = fastapi.APIRouter(prefix="/api/v1")

    @api.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @api.get("/get_server_capabilities")
    async def capabilities() -> dict:
        return service.capabilities()

    @api.post("/client/config")
    async def client_config() -> dict:
        return CLIENT_CONFIG

    @api.post("/client/dynamic_config")
    async def client_dynamic_config() -> dict:
        return DYNAMIC_CONFIG

    @api.post("/create_session")
    async def create_session(body: bodies.CreateSessionBody, who: Owner) -> dict:
        session_id = service.registry.new_session(who)
        log.info("session %s created (sdk %s)", session_id, body.sdk_version or "?")
        return {"type": "create_session", "session_id": session_id}

    @api.post("/session_heartbeat")
    async def session_heartbeat(body: bodies.SessionIdBody, who: Owner) -> dict:
        service.registry.check_session(body.session_id, who)
        return {"type": "session_heartbeat"}

    @api.post("/sessions/{session_id}/finish")
    async def finish_session(session_id: str, who: Owner) -> dict:
        service.end_session(session_id, who)
        return {}

    @api.post("/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    @api.post("/create_model")
    async def create_model(body: bodies.CreateModelBody, who: Owner) -> dict:
        return service.create_model(body, who)

    @api.post("/get_info")
    async def get_info(body: bodies.GetInfoBody, who: Owner) -> dict:
        return service.get_info(body.model_id, who)

    @api.post("/forward_backward")
    async def forward_backward(request: Request, who: Owner) -> dict:
        if wire.PROTOBUF not in request.headers.get("content-type", ""):
            raise ServeError(f"forward_backward takes a protobuf body (Content-Type: {wire.PROTOBUF})")
        body = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":  # the server asks clients not to
            try:
                import zstandard
            except ImportError:
                needs = "a zstd-compressed body needs the zstandard package on the server; send it uncompressed"
                raise ServeError(needs) from None
            body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
        return service.forward_backward(wire.decode_forward_backward(body), who)

    @api.post("/optim_step")
    async def optim_step(body: bodies.OptimStepBody, who: Owner) -> dict:
        return service.optim_step(body, who)

    @api.post("/save_weights")
    async def save_weights(body: bodies.SaveWeightsBody, who: Owner) -> dict:
        return service.save_state(body, who)

    @api.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(body: bodies.SaveForSamplerBody, who: Owner) -> dict:
        return service.save_for_sampler(body, who)

    @api.post("/load_weights")
    async def load_weights(body: bodies.LoadWeightsBody, who: Owner) -> dict:
        return service.load_weights(body, who)

    @api.post("/create_sampling_session")
    async def create_sampling_session(body: bodies.CreateSamplingSessionBody, who: Owner) -> dict:
        return service.create_sampling_session(body, who)

    @api.post("/join_sampling_session")
    async def join_sampling_session(body: bodies.SamplingSessionIdBody, who: Owner) -> dict:
        client = service.registry.join_sampler(body.sampling_session_id, who)
        return {"type": "join_sampling_session", "client_counter": client}

    @api.get("/samplers/{sampling_session_id}")
    async def sampler(sampling_session_id: str, who: Owner) -> dict:
        return service.sampler_info(sampling_session_id, who)

    @api.post("/asample")
    async def asample(body: bodies.SampleBody, who: Owner) -> dict:
        return service.asample(body, who)

    @api.get("/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str) -> dict:
        return service.list_checkpoints(model_id)

    @api.post("/retrieve_future")
    async def retrieve_future(body: bodies.RequestIdBody) -> Any:
        try:
            payload = await service.futures.wait(body.request_id, poll_s)
        except KeyError:
            raise ServeError(
                f"unknown request id {body.request_id!r} (futures do not outlive the server)", 404
            ) from None
        if payload is None:
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        if isinstance(payload, bytes):
            return Response(content=payload, media_type=wire.PROTOBUF)
        return payload

    @api.post("/cancel_future")
    async def cancel_future(body: bodies.RequestIdBody) -> dict:
        service.futures.cancel(body.request_id)
        return {}

    def unsupported_route(message: str) -> Any:
        async def route() -> None:
            raise ServeError(message)

        return route

    for path, message in UNSUPPORTED.items():
        app.add_api_route(path, unsupported_route(message), methods=["POST"], include_in_schema=False)
    app.include_router(api)
    return app
