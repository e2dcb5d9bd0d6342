"""The scale-out files (docs/scaling.md) held to what they must say, since no Kubernetes runs here:

- configs/ray-serve.yaml and the RayService's serveConfigV2 (deploy/ray-service.yaml) are valid Ray Serve
  configs (Ray's own schema) whose application is graphserve's, with graphserve settings build_app takes;
  the RayService runs the installed Ray version in graphserve's Ray Serve mode, a head that holds no replica
  and a GPU worker group with the models volume;
- deploy/inference-gateway.yaml: the InferencePool selects the pods of deploy/kubernetes.yaml on their port
  and names its endpoint picker's Service; the picker runs with that pool and its config file; the engine
  config it reads metrics by is the one the pods' engine-type label selects;
- every metric name the picker is configured with is on a running server's /metrics with the protocol's
  type and meaning: queued and running requests gauges (one request running and one waiting with one
  sequence slot), KV-cache utilization a gauge from 0 to 1, the cache layout's labels, the LoRA gauge's."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray.serve.schema import ServeDeploySchema

from graphserve import AsyncEngine, EngineConfig
from graphserve.server.app import create_app
from graphserve.server.ray_app.app import RAY_SERVE_MODE, REPLICA_DEPLOYMENT, build_app
from live_server import BackgroundServer

ROOT = Path(__file__).resolve().parents[1]
RAY_SERVE_CONFIG = ROOT / "configs" / "ray-serve.yaml"
RAY_SERVICE = ROOT / "deploy" / "ray-service.yaml"
GATEWAY = ROOT / "deploy" / "inference-gateway.yaml"
K8S = ROOT / "deploy" / "kubernetes.yaml"
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
REPLICA_PORT = 8000
DEPRECATED_METRIC_FLAGS = ("--total-queued-requests-metric", "--total-running-requests-metric",
                           "--kv-cache-usage-percentage-metric", "--lora-info-metric", "--cache-info-metric")


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def one(path: Path, kind: str) -> dict:
    (found,) = [d for d in documents(path) if d["kind"] == kind]
    return found


def containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


# ---- Ray Serve ------------------------------------------------------------------------------------


def serve_configs() -> dict[str, dict]:
    service = one(RAY_SERVICE, "RayService")
    return {"configs/ray-serve.yaml": yaml.safe_load(RAY_SERVE_CONFIG.read_text()),
            "deploy/ray-service.yaml serveConfigV2": yaml.safe_load(service["spec"]["serveConfigV2"])}


@pytest.mark.parametrize("name", list(serve_configs()))
def test_the_ray_serve_configs_are_valid_and_run_graphserve(name):
    config = serve_configs()[name]
    schema = ServeDeploySchema.parse_obj(config)  # Ray's own validation of a Serve config file
    (app,) = schema.applications
    assert app.import_path == "graphserve.server.ray_app.app:build_app"
    assert app.route_prefix == "/"
    build_app(app.args)  # the settings are graphserve's (unknown keys, bad values and missing presets raise)
    assert [d.name for d in app.deployments] == [REPLICA_DEPLOYMENT]
    assert app.deployments[0].ray_actor_options.num_cpus >= 1


def test_the_ray_service_runs_this_ray_on_a_head_and_a_gpu_worker_group():
    service = one(RAY_SERVICE, "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    head, (workers,) = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replica (no engine) on the head
    head_ports = {p["name"]: p["containerPort"] for p in containers(head["template"])[0]["ports"]}
    assert head_ports["serve"] == REPLICA_PORT and "gcs" in head_ports
    (worker,) = containers(workers["template"])
    replica = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["deployments"][0]
    gpus_per_pod = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus_per_pod >= replica["ray_actor_options"]["num_gpus"] >= 1
    assert {c["image"] for c in containers(head["template"])} == {worker["image"]}
    for container in (*containers(head["template"]), worker):  # the Ray Serve mode graphserve runs in
        assert {e["name"]: e["value"] for e in container["env"]}.items() >= RAY_SERVE_MODE.items()
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in workers["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    (volume,) = [name for name, path in mounts.items() if path == "/models"]
    assert claims[volume] == one(K8S, "PersistentVolumeClaim")["metadata"]["name"]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]


# ---- the Gateway API Inference Extension --------------------------------------------------------


def graphserve_pods() -> dict:
    return one(K8S, "Deployment")["spec"]["template"]


def picker_container() -> dict:
    (container,) = containers(one(GATEWAY, "Deployment")["spec"]["template"])
    return container


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def picker_config() -> dict:
    """The EndpointPickerConfig the picker reads: its --config-file, found through its volume mount."""
    deployment = one(GATEWAY, "Deployment")
    path = Path(flag(picker_container()["args"], "--config-file"))
    (mount,) = [m for m in picker_container()["volumeMounts"] if path.parent == Path(m["mountPath"])]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = one(GATEWAY, "ConfigMap")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    return yaml.safe_load(config_map["data"][path.name])


def graphserve_metric_specs() -> dict[str, str]:
    config = picker_config()
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == graphserve_pods()["metadata"]["labels"][
        ENGINE_TYPE_LABEL]]
    assert params["defaultEngine"] == engine["name"]  # pods without the label are read the same way
    return engine


def test_the_pool_selects_the_graphserve_pods_and_names_its_picker():
    pool = one(GATEWAY, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= graphserve_pods()["metadata"]["labels"].items()
    ports = {p["containerPort"] for c in containers(graphserve_pods()) for p in c["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [REPLICA_PORT] and REPLICA_PORT in ports
    picker = pool["spec"]["endpointPickerRef"]
    service = one(GATEWAY, "Service")
    assert picker["name"] == service["metadata"]["name"]
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert service["spec"]["selector"].items() <= one(GATEWAY, "Deployment")["spec"]["template"]["metadata"][
        "labels"].items()
    args = picker_container()["args"]
    assert flag(args, "--pool-name") == pool["metadata"]["name"]
    assert not [a for a in args if a.split("=")[0] in DEPRECATED_METRIC_FLAGS]  # v1.5 refuses them
    route = one(GATEWAY, "HTTPRoute")
    assert [b["name"] for r in route["spec"]["rules"] for b in r["backendRefs"] if b["kind"] == "InferencePool"] == [
        pool["metadata"]["name"]]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    """One sequence slot: a second request waits, so the queued gauge has something to show. LoRA on (no
    adapter needed): the LoRA gauge is there only then."""
    config = EngineConfig(device="cpu", max_num_seqs=1, max_model_len=256, kv_cache_bytes=16 * 1024**2,
                          warm_up=False, enable_lora=True)
    with BackgroundServer(create_app(AsyncEngine(config))) as background:
        background.wait_ready()
        yield background


def scrape(client: httpx.Client) -> dict:
    return {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}


def gauge(families: dict, name: str) -> float:
    family = families[name]
    assert family.type == "gauge", (name, family.type)
    (sample,) = family.samples
    return sample.value


def test_every_metric_the_picker_reads_is_on_a_running_servers_metrics(server):
    specs = graphserve_metric_specs()
    queued, running, kv = specs["queuedRequestsSpec"], specs["runningRequestsSpec"], specs["kvUsageSpec"]
    body = {"prompt": "Once upon a time", "max_tokens": 96, "ignore_eos": True, "stream": True}

    def stream() -> str:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60.0) as response:
            return response.read().decode()

    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        idle = scrape(client)
        assert (gauge(idle, queued), gauge(idle, running), gauge(idle, kv)) == (0, 0, 0)
        (layout,) = idle[specs["cacheInfoSpec"]].samples
        assert int(layout.labels["block_size"]) == server.app.state.graphserve.engine.info.block_size
        assert int(layout.labels["num_gpu_blocks"]) == server.app.state.graphserve.engine.stats().kv_context_blocks
        # vLLM's form of the LoRA gauge, which the picker parses: these labels, the value a time (when the
        # adapters in use last changed)
        (adapters,) = idle[specs["loraSpec"]].samples
        assert idle[specs["loraSpec"]].type == "gauge"
        assert adapters.labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert adapters.value >= 0
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream) for _ in range(2)]
            deadline = time.monotonic() + 30
            while (busy := scrape(client)) and (gauge(busy, running), gauge(busy, queued)) != (1, 1):
                assert time.monotonic() < deadline, "never one request running and one waiting"
                time.sleep(0.02)
            assert 0 < gauge(busy, kv) <= 1
            assert all(s.result(timeout=60).endswith("data: [DONE]\n\n") for s in streams)
        deadline = time.monotonic() + 10
        while (after := scrape(client)) and (gauge(after, running), gauge(after, queued), gauge(after, kv)) != (0, 0, 0):
            assert time.monotonic() < deadline, "the gauges did not return to 0"
            time.sleep(0.05)
