"""deploy/ and the images: manifests checked against their published schemas, the CPU image's command run
outside Docker (there is no Docker here) on the demo, and the Grafana dashboard's queries against the
metrics that gateway exports."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import processes
import pytest
import torch
import yaml
from dockerfile_parse import DockerfileParser
from processes import REPO
from prometheus_client.parser import text_string_to_metric_families

from app.config import load_settings

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "warmgate.json"
OLDEST_KUBERNETES = "1.30.0"  # the manifests use nothing newer; also checked against the newest schema shipped
# Grafana's variables are not PromQL: each stands for what Grafana puts in its place.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}


def _manifests() -> dict[str, dict[str, Any]]:
    docs = [d for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_kubernetes_manifests_match_the_kubernetes_schemas_and_each_other(tmp_path: Path) -> None:
    manifests = _manifests()
    assert set(manifests) == {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"}
    import kubernetes_validate  # here, not at the top: the GPU machine runs this module's gpu test without it

    for version in (OLDEST_KUBERNETES, kubernetes_validate.utils.latest_version()):
        for kind, manifest in manifests.items():
            try:  # strict: an unknown or misspelt field fails too
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{kind} against Kubernetes {version}: {exc.message} at {'.'.join(map(str, exc.path))}")

    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    gateway = pod["containers"][0]
    assert gateway["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gateway["startupProbe"]["httpGet"]["path"] == gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    # The config file is the gateway's own: it must load, and the pod must outlive its drain.
    config = tmp_path / "warmgate.toml"
    config.write_text(manifests["ConfigMap"]["data"]["warmgate.toml"])
    settings = load_settings(config)
    pre_stop = int(gateway["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + settings.restart.drain_timeout + 10
    # A subPath mount would never see a ConfigMap update, and `warmgate reload` would re-read the old file.
    mount = next(m for m in gateway["volumeMounts"] if m["name"] == "config")
    assert "subPath" not in mount and f"{mount['mountPath']}/warmgate.toml" in gateway["args"]
    labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert manifests["Service"]["spec"]["selector"].items() <= labels.items()
    assert manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_compose_files_match_the_compose_spec() -> None:
    files = [DEPLOY / "compose.yaml", DEPLOY / "compose.cuda.yaml"]
    # check-jsonschema ships the compose-spec schema (vendored from SchemaStore): no network needed.
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          *map(str, files)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    compose = yaml.safe_load(files[0].read_text())
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["gateway:8000"]
    assert compose["services"]["gateway"]["ports"] == ["8000:8000"]


def _parse(path: Path) -> DockerfileParser:
    # From the bytes: a path is taken for a build directory unless the file is named Dockerfile.
    return DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))


def _dockerfile(path: Path) -> dict[str, str]:
    """The image's instructions by name (the last of each: the one that takes effect), plus its ENV."""
    parsed = _parse(path)
    return {**{i["instruction"]: i["value"] for i in parsed.structure}, **parsed.envs}


def test_the_images_install_with_make_setup_run_as_a_user_and_keep_the_run_dir_on_a_volume() -> None:
    for path in (REPO / "Dockerfile", DEPLOY / "Dockerfile.cuda"):
        image = _dockerfile(path)
        runs = [i["value"] for i in _parse(path).structure if i["instruction"] == "RUN"]
        assert any(run.startswith("make setup ") for run in runs), path  # the Makefile's install steps
        assert image["USER"] not in ("root", "0"), path
        assert Path(image["WARMGATE_RUN_DIR"]).parent == Path(image["VOLUME"]), path
        assert "/ready" in image["HEALTHCHECK"], path
        assert json.loads(image["ENTRYPOINT"]) == ["tini", "--", "warmgate"], path  # an init as PID 1
        assert json.loads(image["CMD"]) == ["serve"], path


@dataclass
class ImageGateway(processes.Gateway):
    env: dict[str, str] = field(default_factory=dict)  # the container's environment, as run here


@pytest.fixture(scope="module")
def image_gateway(demo_path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageGateway]:
    """The CPU image's ENTRYPOINT + CMD with its ENV, outside Docker: what `docker run warmgate` starts.

    Changed, as `docker run -e` would: the port (a free one), the address (loopback: nothing here listens
    beyond this machine), the run dir (under a fresh directory of mode 0777, as a Kubernetes emptyDir is)
    and the model cache dir (the image builds the demo into its own; here, this machine's demo).
    """
    demo_path("fp8-block")  # what the image's build step made
    image = _dockerfile(REPO / "Dockerfile")
    argv = json.loads(image["ENTRYPOINT"]) + json.loads(image["CMD"])
    argv = argv[argv.index("--") + 1 :]  # what the image's init (tini, PID 1 there, not installed here) runs
    argv[0] = shutil.which(argv[0], path=str(Path(sys.executable).parent)) or argv[0]  # the image's PATH: its venv
    root = tmp_path_factory.mktemp("image")
    volume = root / "volume"
    volume.mkdir(mode=0o777)
    volume.chmod(0o777)
    run_dir = volume / Path(image["WARMGATE_RUN_DIR"]).relative_to(image["VOLUME"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMGATE_")}
    env.update({k: v for k, v in _parse(REPO / "Dockerfile").envs.items()
                if k not in ("PATH", "WARMGATE_CACHE_DIR")})  # fmt: skip
    env.update(WARMGATE_RUN_DIR=str(run_dir), WARMGATE_GATEWAY__PORT="0", WARMGATE_GATEWAY__HOST="127.0.0.1")
    if "WARMGATE_CACHE_DIR" in os.environ:
        env["WARMGATE_CACHE_DIR"] = os.environ["WARMGATE_CACHE_DIR"]
    log_path = root / "serve.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    gw = ImageGateway(proc, "", run_dir, None, log_path, env)
    processes.wait_until_ready(gw)
    yield gw
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]


def test_the_image_command_serves_the_demo_to_the_openai_client(image_gateway: ImageGateway) -> None:
    client = openai.OpenAI(base_url=f"{image_gateway.url}/v1", api_key="unused", timeout=120, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    assert model == "smollm2-135m-instruct-fp8-block"
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0
    )
    assert "Paris" in (chat.choices[0].message.content or "")
    # The image's HEALTHCHECK, run the way Docker runs it (a shell, the container's environment).
    check = _dockerfile(REPO / "Dockerfile")["HEALTHCHECK"].split(" CMD ", 1)[1]
    # The gateway took any free port here (--port 0, so parallel tests never race for one); the image's fixed port
    # is the one its healthcheck reads from the environment: give it the one taken.
    port = image_gateway.url.rsplit(":", 1)[1]
    env = {**image_gateway.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "WARMGATE_GATEWAY__PORT": port}  # fmt: skip
    assert subprocess.run(["sh", "-c", check], env=env, timeout=60).returncode == 0
    assert image_gateway.run_dir.stat().st_mode & 0o777 == 0o700  # made private inside the 0777 volume


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU: test_auto_picks_cuda_where_torch_sees_a_gpu")
def test_auto_picks_the_cpu_where_torch_sees_no_gpu(image_gateway: ImageGateway) -> None:
    assert "event=device setting=auto engines=cpu cache=cpu" in image_gateway.log_path.read_text()
    assert image_gateway.status()["cache"]["device"] == "cpu"


@pytest.mark.gpu
def test_auto_picks_cuda_where_torch_sees_a_gpu(image_gateway: ImageGateway) -> None:
    cuda = f"cuda:{torch.cuda.current_device()}"
    assert f"event=device setting=auto engines={cuda} cache={cuda}" in image_gateway.log_path.read_text()
    status = image_gateway.status()
    assert status["cache"]["device"] == cuda
    assert all(e["device_memory_bytes"] for e in status["engines"] if e["state"] in ("active", "standby"))


def _dashboard_metrics() -> set[str]:
    """Every metric name the dashboard's queries (and its variables) select, found by a PromQL parser."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(SELECTOR, label)
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", variable["definition"])
            assert match, variable["definition"]
            queries.append(match[1])
    import promql_parser  # here, not at the top: the GPU machine runs this module's gpu test without it

    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    for query in queries:
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        promql_parser.walk(promql_parser.parse(query), visit)  # a query that does not parse fails here
    return names


def test_every_metric_the_dashboard_queries_is_exported(image_gateway: ImageGateway) -> None:
    client = openai.OpenAI(base_url=f"{image_gateway.url}/v1", api_key="unused", timeout=120, max_retries=0)
    client.chat.completions.create(model="smollm2-135m-instruct-fp8-block", max_tokens=1,
                                   messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    exposition = httpx.get(f"{image_gateway.url}/metrics", timeout=30).text
    exported = {s.name for family in text_string_to_metric_families(exposition) for s in family.samples}
    queried = _dashboard_metrics()
    assert len(queried) >= 15, queried  # the parser found the queries' metrics, not nothing
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"
    samples = {s.name: s.value for family in text_string_to_metric_families(exposition) for s in family.samples}
    assert samples["warmgate:cache_bytes"] > 0 and samples["warmgate:cache_leases"] >= 1  # read from the cache


def test_the_inference_pool_example_selects_the_deployments_pods_on_the_gateways_port() -> None:
    """deploy/k8s/inference-gateway/: an InferencePool (the Gateway API Inference Extension's v1 API) whose members
    are exactly the Deployment's pods, on the port the gateway listens on in the CUDA image (its API and /metrics,
    which the endpoint picker scrapes), and an HTTPRoute that sends the OpenAI routes to it."""
    path = DEPLOY / "k8s" / "inference-gateway" / "inferencepool.yaml"
    docs = {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}
    assert set(docs) == {"InferencePool", "HTTPRoute"}
    pool = docs["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"]
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}, spec  # the v1 spec's fields
    deployment = _manifests()["Deployment"]
    template = deployment["spec"]["template"]
    # The v1 selector has matchLabels only; the Deployment's own selector: every pod it makes, and only those.
    assert spec["selector"] == {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}
    assert spec["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()

    container = template["spec"]["containers"][0]
    listens = int(_dockerfile(DEPLOY / "Dockerfile.cuda")["WARMGATE_GATEWAY__PORT"])
    assert [p["number"] for p in spec["targetPorts"]] == [listens]
    assert listens in [p["containerPort"] for p in container["ports"]]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(listens)  # /metrics on the same port
    assert spec.get("appProtocol", "http") == "http"  # HTTP/1.1: what the relays speak
    picker = spec["endpointPickerRef"]
    assert picker.get("kind", "Service") == "Service" and picker["name"] and 0 < picker["port"]["number"] < 65536

    route = docs["HTTPRoute"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]  # fmt: skip
    assert [m["path"]["value"] for m in rule["matches"]] == ["/v1"]  # the OpenAI API; /admin and /metrics stay inside
