"""Ray Serve LLM app: vLLM 0.26 with the InfiniteHiP backend, behind an OpenAI API that asks for
an API key.

``import_path: deploy.serve.app:build_app`` (config-cpu.yaml, config-gpu.yaml, the RayService).
``args`` are those of Ray Serve LLM's ``build_openai_app`` (``LLMServingArgs``: ``llm_configs``,
``ingress_deployment_config``); each LLM config's ``engine_kwargs`` must select the backend with
the flat engine argument ``attention_backend: infinitehip`` and put its settings in
``additional_config: {infinitehip: {...}}``.

Why not ``build_openai_app`` itself: its ingress has no authentication (Ray Serve LLM does not read
``VLLM_API_KEY``). :func:`build_app` composes the same public pieces (``LLMServingArgs``,
``build_llm_deployment``, ``make_fastapi_ingress``, ``OpenAiIngress``) and puts
:class:`ApiKeyMiddleware` outermost on the ingress's FastAPI app, so every route, including ones a
later Ray adds, answers 401 without ``Authorization: Bearer <key>``.

The key never appears in a config: each ingress replica reads it from the file named by
``INFINITEHIP_API_KEY_FILE`` (one key per line, ``#`` comments allowed, re-read when the file
changes, so a rotated Kubernetes Secret takes effect without a restart) and/or from
``INFINITEHIP_API_KEY``. With neither, the ingress replica fails at startup: the app does not
serve unauthenticated.

Besides the OpenAI routes, ``GET /v1/infinitehip/stats[?model=ID]`` returns the backend's counters
(``infinitehip_stats`` of every worker of every replica of the model, read-only), through Ray Serve
LLM's ``LLMServer.collective_rpc``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

from ray import serve
from ray.llm._internal.serve.constants import RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, init
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress as _DefaultIngress
from ray.llm._internal.serve.core.ingress.mixins.broadcastable import ReplicaBroadcastable
from ray.serve.deployment import Application
from ray.serve.llm import LLMConfig, LLMServingArgs, build_llm_deployment
from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

API_KEY_ENV = "INFINITEHIP_API_KEY"
API_KEY_FILE_ENV = "INFINITEHIP_API_KEY_FILE"
MIN_KEY_CHARS = 16
BACKEND = "infinitehip"
STATS_ROUTE = "/v1/infinitehip/stats"


class ApiKeyError(RuntimeError):
    """No usable API key: the app refuses to serve."""


def load_api_keys(environ: dict | None = None) -> list[str]:
    """The accepted keys: the lines of ``$INFINITEHIP_API_KEY_FILE``, and
    ``$INFINITEHIP_API_KEY``."""
    env = os.environ if environ is None else environ
    keys: list[str] = []
    path = env.get(API_KEY_FILE_ENV)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ApiKeyError(f"{API_KEY_FILE_ENV}={path}: cannot read it ({e})") from None
        lines = (line.strip() for line in text.splitlines())
        keys += [s for s in lines if s and not s.startswith("#")]
    if env.get(API_KEY_ENV, "").strip():
        keys.append(env[API_KEY_ENV].strip())
    if not keys:
        raise ApiKeyError(
            f"no API key: set {API_KEY_FILE_ENV} to a file holding it (one key per line) or "
            f"{API_KEY_ENV}, on every node that runs the ingress; this app does not serve "
            "unauthenticated"
        )
    if any(len(k) < MIN_KEY_CHARS for k in keys):
        raise ApiKeyError(
            f"an API key is shorter than {MIN_KEY_CHARS} characters (`openssl rand -hex 32`)"
        )
    return keys


class _Keys:
    """The accepted keys as SHA-256 digests, re-read when the key file changes (rotation)."""

    def __init__(self) -> None:
        self._stamp: Any = object()
        self._digests: list[bytes] = []

    def _file_stamp(self) -> Any:
        path = os.environ.get(API_KEY_FILE_ENV)
        if not path:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return ("missing", path)
        return (path, st.st_mtime_ns, st.st_size, st.st_ino)

    def digests(self) -> list[bytes]:
        stamp = self._file_stamp()
        if stamp != self._stamp:
            self._digests = [hashlib.sha256(k.encode()).digest() for k in load_api_keys()]
            self._stamp = stamp
        return self._digests


class ApiKeyMiddleware:
    """Pure ASGI middleware: an HTTP or websocket request passes only with
    ``Authorization: Bearer <key>`` for one of the accepted keys (compared in constant time);
    otherwise 401 (websocket: close 1008). ``OPTIONS`` passes (CORS preflight; no route answers
    it), as in vLLM's own ``--api-key`` middleware; lifespan events pass."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.keys = _Keys()

    def authorized(self, scope: dict) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return False
        digest = hashlib.sha256(token.encode()).digest()
        ok = False
        for accepted in self.keys.digests():
            ok |= hmac.compare_digest(digest, accepted)
        return ok

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or scope.get("method") == "OPTIONS"
            or self.authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = {"error": {"message": "missing or wrong API key: send 'Authorization: Bearer <key>'",
                          "type": "authentication_error", "code": 401}}  # fmt: skip
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
            scope, receive, send
        )


class InfiniteHiPIngress(OpenAiIngress, ReplicaBroadcastable):
    """Ray Serve LLM's OpenAI ingress, plus ``GET /v1/infinitehip/stats``. Its replica checks at
    startup that an API key is configured (the middleware reads it per request)."""

    def __init__(self, llm_deployments: dict, model_cards: dict, **kwargs: Any) -> None:
        load_api_keys()  # fail the deployment here, not at the first request
        super().__init__(llm_deployments, model_cards, **kwargs)

    async def infinitehip_stats(self, model: str | None = None) -> JSONResponse:
        """The backend's counters: one list per replica, one dict per worker (TP/PP rank)."""
        model_id = await self._get_model_id(model)
        per_replica = await self._broadcast_to_replicas(
            model_id, "collective_rpc",
            kwargs={"method": "infinitehip_stats", "kwargs": {"reset": False}},
        )  # fmt: skip
        return JSONResponse({"model": model_id,
                             "replicas": [list(r or []) for r in per_replica or []]})  # fmt: skip


ENDPOINTS = {**DEFAULT_ENDPOINTS, "infinitehip_stats": lambda app: app.get(STATS_ROUTE)}


def _plugins_env(llm_config: LLMConfig) -> str | None:
    env_vars = (llm_config.runtime_env or {}).get("env_vars") or {}
    return env_vars.get("VLLM_PLUGINS", os.environ.get("VLLM_PLUGINS"))


def check_llm_config(llm_config: LLMConfig) -> None:
    """Refuse a config that would not run InfiniteHiP, with the reason and the fix."""
    kw = llm_config.engine_kwargs
    where = f"llm_configs[{llm_config.model_id}].engine_kwargs"
    attention_config = kw.get("attention_config") or {}
    if isinstance(attention_config, dict) and "backend" in attention_config:
        raise ValueError(
            f"{where}.attention_config.backend: vLLM validates it before plugins load, so "
            f"`{BACKEND}` is unknown there; use the flat engine argument "
            f"`attention_backend: {BACKEND}`"
        )
    if str(kw.get("attention_backend", "")).lower() != BACKEND:
        got = kw.get("attention_backend")
        raise ValueError(f"{where}.attention_backend must be `{BACKEND}` (got {got!r})")
    extra = kw.get("additional_config") or {}
    if not isinstance(extra, dict):
        raise TypeError(f"{where}.additional_config must be a mapping")
    from vllm_infinitehip.config import InfiniteHiPConfig

    InfiniteHiPConfig.from_user(extra.get(BACKEND))  # raises naming the bad field
    plugins = _plugins_env(llm_config)
    if plugins is not None and BACKEND not in [p.strip() for p in plugins.split(",")]:
        raise ValueError(
            f"VLLM_PLUGINS={plugins!r} does not list `{BACKEND}`: vLLM would not load the plugin"
        )
    if getattr(llm_config.accelerator_config, "kind", None) == "cpu":
        # vLLM's CPU platform refuses the ray executor, which it picks by itself inside a Ray
        # placement group when TP > 1 (Ray 2.58.1 also forces mp for `kind: cpu`)
        kw.setdefault("distributed_executor_backend", "mp")


def build_app(args: dict) -> Application:
    """The app of ``serve run`` / ``serve deploy`` / RayService ``serveConfigV2``: ``args`` are
    ``LLMServingArgs`` (as for ``build_openai_app``)."""
    if RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING:
        raise ValueError(
            "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 serves through the LLM server directly, "
            "bypassing this app's ingress and its API key: unset it"
        )
    serving = LLMServingArgs.model_validate(args)
    ingress_cls_config = serving.ingress_cls_config
    ingress = ingress_cls_config.ingress_cls
    if ingress is _DefaultIngress:  # not set
        ingress = InfiniteHiPIngress
    elif not (isinstance(ingress, type) and issubclass(ingress, InfiniteHiPIngress)):
        raise ValueError(
            "ingress_cls_config.ingress_cls must subclass deploy.serve.app.InfiniteHiPIngress "
            "(the ingress that checks the API key)"
        )
    llm_configs = serving.llm_configs
    for c in llm_configs:
        check_llm_config(c)
    llm_deployments = {c.model_id: build_llm_deployment(c) for c in llm_configs}
    model_cards = {c.model_id: to_model_metadata(c.model_id, c) for c in llm_configs}
    lora_paths = {c.model_id: c.lora_config.dynamic_lora_loading_path
                  for c in llm_configs if c.lora_config is not None}  # fmt: skip

    from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults

    options = maybe_apply_llm_deployment_config_defaults(
        ingress.get_deployment_options(llm_configs), serving.ingress_deployment_config
    )
    fastapi_app = init()  # Ray Serve LLM's app: its exception handling, CORS, metrics, request ids
    fastapi_app.add_middleware(ApiKeyMiddleware)  # added last = outermost: runs first
    ingress_cls = make_fastapi_ingress(ingress, endpoint_map=ENDPOINTS, app=fastapi_app)
    return serve.deployment(ingress_cls, **options).bind(
        llm_deployments=llm_deployments, model_cards=model_cards, lora_paths=lora_paths,
        **(ingress_cls_config.ingress_extra_kwargs or {}),
    )  # fmt: skip
