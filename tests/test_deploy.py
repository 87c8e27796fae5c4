"""deploy/: every YAML parses and names things that exist, checked against the installed Ray
2.58.1 and vLLM 0.26 (Serve schema, LLMConfig, vLLM's engine and CLI arguments, the cluster
launcher's schema and `ray start` options), KubeRay's ray.io/v1 field names, and the Dockerfile's
pins; and the API-key middleware of deploy/serve/app.py on a bare ASGI app (no cluster).
The Serve app itself runs in tests/test_ray_serve.py."""

from __future__ import annotations

import copy
import itertools
import re
import shlex
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SERVE_CONFIGS = {"cpu": DEPLOY / "serve" / "config-cpu.yaml",
                 "gpu": DEPLOY / "serve" / "config-gpu.yaml"}  # fmt: skip
RAYSERVICE = DEPLOY / "kuberay" / "rayservice.yaml"
NETWORKPOLICY = DEPLOY / "kuberay" / "networkpolicy.yaml"
INGRESS = DEPLOY / "kuberay" / "ingress.yaml"
CLUSTER = DEPLOY / "ray" / "cluster.yaml"
LAUNCH = DEPLOY / "ray" / "launch_vllm.sh"
DOCKERFILE = DEPLOY / "Dockerfile"
README = DEPLOY / "README.md"
RAY_INTERNAL_PORTS = {6379, 8265, 10001}
# an image by digest: the placeholder until the user's build, or a real sha256
IMAGE_BY_DIGEST = re.compile(r"^[^\s@:]+(/[^\s@:]+)*@sha256:(IMAGE_DIGEST|[0-9a-f]{64})$")

# KubeRay's ray.io/v1 JSON field names (ray-operator/apis/ray/v1/rayservice_types.go and
# raycluster_types.go: RayServiceSpec, RayClusterSpec (authOptions since KubeRay 1.5.1),
# HeadGroupSpec, WorkerGroupSpec), so a misspelt field fails here, not in the API server
RAYSERVICE_SPEC = {
    "serveConfigV2",
    "rayClusterConfig",
    "upgradeStrategy",
    "serveService",
    "excludeHeadPodFromServeSvc",
    "rayClusterDeletionDelaySeconds",
    "serviceUnhealthySecondThreshold",
    "deploymentUnhealthySecondThreshold",
}
RAYCLUSTER_SPEC = {
    "headGroupSpec",
    "workerGroupSpecs",
    "rayVersion",
    "enableInTreeAutoscaling",
    "autoscalerOptions",
    "headServiceAnnotations",
    "suspend",
    "managedBy",
    "gcsFaultToleranceOptions",
    "authOptions",
    "upgradeStrategy",
    "historyServerOptions",
    "networkPolicy",
    "tlsOptions",
}
HEAD_GROUP = {
    "serviceType",
    "headService",
    "enableIngress",
    "ingressOptions",
    "resources",
    "labels",
    "rayStartParams",
    "template",
}
WORKER_GROUP = {
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "numOfHosts",
    "idleTimeoutSeconds",
    "priority",
    "resources",
    "labels",
    "rayStartParams",
    "template",
    "scaleStrategy",
    "suspend",
}
AUTH_OPTIONS = {"mode", "secretName", "enableK8sTokenAuth"}
# core/v1 names used in the pod templates
POD_SPEC = {
    "containers",
    "initContainers",
    "volumes",
    "securityContext",
    "serviceAccountName",
    "nodeSelector",
    "tolerations",
    "affinity",
    "imagePullSecrets",
    "priorityClassName",
}
CONTAINER = {
    "name",
    "image",
    "imagePullPolicy",
    "command",
    "args",
    "env",
    "envFrom",
    "ports",
    "resources",
    "volumeMounts",
    "securityContext",
    "lifecycle",
    "readinessProbe",
    "livenessProbe",
    "startupProbe",
    "workingDir",
}


def load(path: Path) -> dict:
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    return doc


def serve_configs() -> dict[str, dict]:
    out = {name: load(path) for name, path in SERVE_CONFIGS.items()}
    out["rayservice"] = yaml.safe_load(load(RAYSERVICE)["spec"]["serveConfigV2"])
    return out


def test_every_yaml_under_deploy_parses():
    paths = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert {p.relative_to(DEPLOY).as_posix() for p in paths} >= {
        "serve/config-cpu.yaml",
        "serve/config-gpu.yaml",
        "ray/cluster.yaml",
        "kuberay/rayservice.yaml",
        "kuberay/networkpolicy.yaml",
        "kuberay/ingress.yaml",
    }
    for path in paths:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), path
    assert isinstance(yaml.safe_load(load(RAYSERVICE)["spec"]["serveConfigV2"]), dict)


# ------------------------------------------------------------------------------ Ray Serve
@pytest.mark.parametrize("name", ["cpu", "gpu", "rayservice"])
def test_serve_config_matches_rays_serve_schema(name):
    pytest.importorskip("ray.serve")
    from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    cfg = serve_configs()[name]
    ServeDeploySchema.model_validate(cfg)  # ignores unknown keys: check the names as well
    assert set(cfg) <= set(ServeDeploySchema.model_fields)
    assert set(cfg["http_options"]) <= set(HTTPOptionsSchema.model_fields)
    for app in cfg["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields)
    # local only by default; inside Kubernetes the NetworkPolicy and the API key guard it
    assert cfg["http_options"]["host"] == ("0.0.0.0" if name == "rayservice" else "127.0.0.1")


def test_rayservice_serves_the_gpu_config_application():
    assert serve_configs()["rayservice"]["applications"] == serve_configs()["gpu"]["applications"]


@pytest.mark.parametrize("name", ["cpu", "gpu", "rayservice"])
def test_serve_app_import_path_and_llm_configs_resolve(name, tiny_model):
    pytest.importorskip("ray.serve.llm")
    import dataclasses
    import inspect

    from ray._common.utils import import_attr
    from ray.serve.llm import LLMServingArgs
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import FrontendArgs

    import vllm_infinitehip
    from deploy.serve import app as serve_app
    from vllm_infinitehip.config import InfiniteHiPConfig

    (app,) = serve_configs()[name]["applications"]
    builder = import_attr(app["import_path"])
    assert builder is serve_app.build_app and len(inspect.signature(builder).parameters) == 1
    serving = LLMServingArgs.model_validate(app["args"])  # LLMConfig forbids unknown fields
    engine_fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    frontend_fields = {f.name for f in dataclasses.fields(FrontendArgs)}
    vllm_infinitehip.register()
    from vllm.config import AttentionConfig

    for llm in serving.llm_configs:
        kw = llm.engine_kwargs
        assert set(kw) <= engine_fields | frontend_fields, set(kw) - engine_fields - frontend_fields
        assert kw["attention_backend"] == "infinitehip" and "attention_config" not in kw
        assert AttentionConfig(backend=kw["attention_backend"]).backend.name == "INFINITEHIP"
        InfiniteHiPConfig.from_user(kw["additional_config"]["infinitehip"])
        serve_app.check_llm_config(llm)
        init = llm.get_engine_config().get_initialization_kwargs()  # Ray's own engine-arg split
        kind = llm.accelerator_config.kind
        assert kind == ("cpu" if name == "cpu" else "gpu")
        # CPU: vLLM's CPU platform refuses the ray executor, so mp, said explicitly
        assert init["distributed_executor_backend"] == ("mp" if kind == "cpu" else "ray")
        if kind == "cpu":
            assert kw["distributed_executor_backend"] == "mp"
        engine_kw = {k: v for k, v in init.items() if k in engine_fields}
        # vLLM takes every engine argument as given (a local model: no hub here)
        AsyncEngineArgs(**{**engine_kw, "model": tiny_model})


def _llm_config(**engine_kwargs):
    from ray.serve.llm import LLMConfig

    kw = {"attention_backend": "infinitehip", **engine_kwargs}
    return LLMConfig(model_loading_config={"model_id": "m", "model_source": "x"},
                     accelerator_config={"kind": "cpu"}, engine_kwargs=kw)  # fmt: skip


def test_check_llm_config_refuses_what_would_not_run_infinitehip(monkeypatch):
    pytest.importorskip("ray.serve.llm")
    from deploy.serve.app import check_llm_config

    with pytest.raises(ValueError, match="flat engine argument"):
        check_llm_config(_llm_config(attention_config={"backend": "infinitehip"}))
    with pytest.raises(ValueError, match="attention_backend must be"):
        check_llm_config(_llm_config(attention_backend="FLASH_ATTN"))
    with pytest.raises(ValueError, match="chunk_size"):
        bad = {"stages": [{"chunk_size": 256, "keep_tokens": 4096},
                          {"chunk_size": 48, "keep_tokens": 480},
                          {"chunk_size": 8, "keep_tokens": 256}]}  # fmt: skip
        check_llm_config(_llm_config(additional_config={"infinitehip": bad}))
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(ValueError, match="VLLM_PLUGINS"):
        check_llm_config(_llm_config())
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver, infinitehip")
    ok = _llm_config()
    check_llm_config(ok)
    assert ok.engine_kwargs["distributed_executor_backend"] == "mp"  # CPU: set when left out


# ------------------------------------------------------------------------------ API key
def _client(monkeypatch, key_file=None, key=None):
    pytest.importorskip("ray.serve.llm")
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from deploy.serve.app import ApiKeyMiddleware

    for var, value in (("INFINITEHIP_API_KEY_FILE", key_file), ("INFINITEHIP_API_KEY", key)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(value))
    inner = Starlette(routes=[Route("/{path:path}", lambda r: PlainTextResponse("ok"),
                                    methods=["GET", "POST"])])  # fmt: skip
    return TestClient(ApiKeyMiddleware(inner))


def test_api_key_middleware_asks_every_route_for_the_key(monkeypatch, tmp_path):
    k1, k2 = "k" * 32, "z" * 40
    key_file = tmp_path / "api_key"
    key_file.write_text(f"# comment\n\n{k1}\n")
    client = _client(monkeypatch, key_file=key_file, key=k2)
    for path in ("/v1/completions", "/v1/models", "/tokenize", "/docs", "/anything"):
        r = client.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == 401
        assert client.get(path, headers={"Authorization": f"Bearer {k1}x"}).status_code == 401
        assert client.get(path, headers={"Authorization": f"Basic {k1}"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer "}).status_code == 401
        for k in (k1, k2):
            assert client.post(path, headers={"Authorization": f"Bearer {k}"}).text == "ok"
    # rotation: the file is re-read when it changes
    k3 = "n" * 32
    key_file.write_text(f"{k3}\n")
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {k1}"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {k3}"}).status_code == 200


def test_no_or_weak_api_key_refuses_to_serve(monkeypatch, tmp_path):
    pytest.importorskip("ray.serve.llm")
    from deploy.serve.app import ApiKeyError, load_api_keys

    with pytest.raises(ApiKeyError, match="no API key"):
        load_api_keys({})
    with pytest.raises(ApiKeyError, match="cannot read"):
        load_api_keys({"INFINITEHIP_API_KEY_FILE": str(tmp_path / "missing")})
    with pytest.raises(ApiKeyError, match="shorter"):
        load_api_keys({"INFINITEHIP_API_KEY": "short"})
    (tmp_path / "only_comments").write_text("# nothing\n")
    with pytest.raises(ApiKeyError, match="no API key"):
        load_api_keys({"INFINITEHIP_API_KEY_FILE": str(tmp_path / "only_comments")})
    client = _client(monkeypatch)
    with pytest.raises(ApiKeyError):
        client.get("/v1/models", headers={"Authorization": "Bearer " + "k" * 32})


# ------------------------------------------------------------------------------ ray up
def test_cluster_config_validates_with_token_auth_and_closed_ports():
    pytest.importorskip("ray.autoscaler")
    from ray.autoscaler._private.util import prepare_config, validate_config
    from ray.scripts.scripts import start

    cfg = load(CLUSTER)
    validate_config(prepare_config(copy.deepcopy(cfg)))  # what `ray up` checks before the cloud
    assert IMAGE_BY_DIGEST.match(cfg["docker"]["image"]), cfg["docker"]["image"]
    assert "--env RAY_AUTH_MODE=token" in cfg["docker"]["run_options"]
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # no extra inbound rule: `ray up`'s group opens SSH and intra-cluster traffic only
    assert not cfg["provider"].get("security_group", {}).get("IpPermissions")
    start_options = {o for p in start.params for o in p.opts}
    commands = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    ray_starts = [c for c in commands if "ray start" in c]
    assert len(ray_starts) == 2
    for command in ray_starts:
        assert "export RAY_AUTH_MODE=token;" in command
        argv = shlex.split(command.split("ray start", 1)[1])
        for arg in argv:
            if arg.startswith("--"):
                assert arg.split("=", 1)[0] in start_options, arg
    (head,) = [c for c in cfg["head_start_ray_commands"] if "ray start" in c]
    assert "--head" in head and "--dashboard-host=127.0.0.1" in head


def _vllm_serve_argv() -> list[str]:
    text = LAUNCH.read_text()
    block = text[text.index("exec vllm serve") :]
    return shlex.split(block.replace("\\\n", " ").splitlines()[0], comments=True)


def test_launch_script_uses_real_vllm_serve_flags():
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    subprocess.run(["bash", "-n", str(LAUNCH)], check=True)
    argv = _vllm_serve_argv()
    assert argv[:3] == ["exec", "vllm", "serve"]
    options = set(make_arg_parser(FlexibleArgumentParser())._option_string_actions)
    flags = [a for a in argv if a.startswith("--")]
    assert flags and set(flags) <= options, set(flags) - options
    pairs = dict(itertools.pairwise(argv))
    assert pairs["--attention-backend"] == "infinitehip"
    assert pairs["--distributed-executor-backend"] == "ray"
    assert pairs["--tensor-parallel-size"] == "$TP"
    assert "--api-key" not in argv  # the key goes through VLLM_API_KEY, not argv
    assert "HOST=${HOST:-127.0.0.1}" in LAUNCH.read_text()


@pytest.mark.parametrize("env, message", [
    ({}, "RAY_AUTH_MODE=token is not set"),
    ({"RAY_AUTH_MODE": "token", "INFINITEHIP_API_KEY_FILE": "/nonexistent"}, "no API key"),
    ({"RAY_AUTH_MODE": "token", "VLLM_PLUGINS": "other"}, "does not list infinitehip"),
])  # fmt: skip
def test_launch_script_refuses_an_insecure_or_pluginless_start(env, message, tmp_path):
    key = tmp_path / "key"
    key.write_text("k" * 32)
    full = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "INFINITEHIP_API_KEY_FILE": str(key),
            **env}  # fmt: skip
    out = subprocess.run(["bash", str(LAUNCH)], env=full, capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode == 1 and message in out.stderr, out.stderr


# ------------------------------------------------------------------------------ KubeRay
def _pod_templates(spec: dict) -> list[dict]:
    cluster = spec["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [g["template"] for g in groups]


def test_rayservice_is_the_ray_io_v1_shape_with_token_auth_and_pinned_images():
    svc = load(RAYSERVICE)
    assert svc["apiVersion"] == "ray.io/v1" and svc["kind"] == "RayService"
    spec = svc["spec"]
    assert set(spec) <= RAYSERVICE_SPEC and isinstance(spec["serveConfigV2"], str)
    cluster = spec["rayClusterConfig"]
    assert set(cluster) <= RAYCLUSTER_SPEC
    assert set(cluster["authOptions"]) <= AUTH_OPTIONS
    # token auth: the operator makes the token's Secret (Kubernetes-delegated auth does not
    # support RayService)
    assert cluster["rayVersion"] == "2.58.1" and cluster["authOptions"] == {"mode": "token"}
    head = cluster["headGroupSpec"]
    assert set(head) <= HEAD_GROUP
    for group in cluster["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP
        assert {"groupName", "rayStartParams", "template"} <= set(group)
    images = set()
    for group in [head, *cluster["workerGroupSpecs"]]:
        # map[string]string
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        pod = group["template"]["spec"]
        assert set(pod) <= POD_SPEC
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            assert set(c) <= CONTAINER, set(c) - CONTAINER
            assert IMAGE_BY_DIGEST.match(c["image"]), c["image"]
            images.add(c["image"])
            env = {e["name"]: e for e in c["env"]}
            # the API key: a file from the Secret, never a literal
            path = env["INFINITEHIP_API_KEY_FILE"]["value"]
            (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            assert volumes[mount["name"]]["secret"]["secretName"] == "infinitehip-api-key"
            assert "INFINITEHIP_API_KEY" not in env
    assert len(images) == 1
    # no Ray port published outside the pod network
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"


def test_networkpolicy_keeps_ray_ports_internal_and_lets_only_serve_out():
    policy, svc = load(NETWORKPOLICY), load(RAYSERVICE)
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for template in _pod_templates(svc["spec"]):
        assert selector.items() <= template["metadata"]["labels"].items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    for rule in policy["spec"]["ingress"]:
        peers = rule["from"]
        ports = {p["port"] for p in rule.get("ports", [])}
        if peers == [{"podSelector": {"matchLabels": selector}}]:
            continue  # the cluster's own pods: every port
        # any other source: named namespaces, and never GCS or Ray Client
        assert ports and all("namespaceSelector" in p and "ipBlock" not in p for p in peers)
        assert not ports & {6379, 10001}
        if 8265 in ports:  # the dashboard: the operator's namespace only
            operator_ns = {"kubernetes.io/metadata.name": "kuberay-system"}
            assert peers == [{"namespaceSelector": {"matchLabels": operator_ns}}]
    assert "--namespace kuberay-system" in README.read_text()


def test_ingress_exposes_only_the_serve_service_over_tls():
    ing, svc = load(INGRESS), load(RAYSERVICE)
    assert ing["apiVersion"] == "networking.k8s.io/v1" and ing["kind"] == "Ingress"
    assert ing["spec"]["tls"]
    backends = [p["backend"]["service"] for r in ing["spec"]["rules"] for p in r["http"]["paths"]]
    # KubeRay's Serve service of a RayService: <name>-serve-svc, port 8000
    assert backends == [{"name": f"{svc['metadata']['name']}-serve-svc", "port": {"number": 8000}}]


# ------------------------------------------------------------------------------ image
def test_dockerfile_pins_base_by_digest_and_versions():
    text = DOCKERFILE.read_text()
    (from_line,) = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert from_line == "FROM ${BASE_IMAGE}@${BASE_DIGEST}"
    digest = re.search(r"^ARG BASE_DIGEST=(\S+)$", text, re.MULTILINE).group(1)
    # a placeholder until the user passes the digest they verified: never a made-up sha256
    assert not re.fullmatch(r"sha256:[0-9a-f]{64}", digest) and "REPLACE" in digest
    assert re.search(r"^ARG BASE_IMAGE=rayproject/ray:2\.58\.1-\S+$", text, re.MULTILINE)
    assert "ARG VLLM_VERSION=0.26.0" in text and "ARG RAY_VERSION=2.58.1" in text
    assert '"vllm==${VLLM_VERSION}" "ray[serve,llm]==${RAY_VERSION}"' in text
    assert "pip install --no-cache-dir /tmp/vllm-infinitehip" in text
    assert "ENV PYTHONPATH=/opt/infinitehip-deploy" in text
    # the build context: nothing but what the image copies (never .venv, .cache, .git)
    ignore = [line for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]  # fmt: skip
    assert ignore[0] == "*"
    assert {line for line in ignore if line.startswith("!")} == {
        "!pyproject.toml",
        "!README.md",
        "!vllm_infinitehip/",
        "!kernels/",
        "!block_manager/",
        "!deploy/",
    }
    readme = README.read_text()
    assert "docker buildx imagetools inspect" in readme


def test_readme_names_files_that_exist():
    readme = README.read_text()
    refs = set(re.findall(r"(?<![\w/-])deploy/[\w./-]+\w", readme))
    # paths inside the image: the Dockerfile copies deploy/ to /opt/infinitehip-deploy/deploy
    in_image = set(re.findall(r"/opt/infinitehip-deploy/(deploy/[\w./-]+\w)", readme))
    assert in_image and "COPY --chown=ray:users deploy /opt/infinitehip-deploy/deploy" in (
        DOCKERFILE.read_text()
    )
    for ref in sorted(refs | in_image):
        assert (ROOT / ref).exists(), ref
