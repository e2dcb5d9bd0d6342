"""graphserve replicas on Ray Serve (server/ray_app/), for real: a local Ray cluster of two nodes with one CPU
each (ray.cluster_utils.Cluster: two raylets on this machine), two replicas of the embedded model (one torch
thread each, so one per node), Ray Serve's HTTP proxy in front, driven with the official openai client and
httpx:

- chat streams through the Ray endpoint with the same text as the whole response; a tool call and a
  structured output come back valid;
- the request router sends a prompt whose prefix a replica holds to that replica (a cache hit there), and
  spreads new prefixes over both; its keys are the engine's block keys of the prompt the replica builds;
- a client that leaves mid-stream has its engine request aborted;
- kill -9 of one replica's engine-core process: its open streams end with an error event and [DONE], the
  other replica's streams finish, requests sent meanwhile are served (by the other replica: a replica
  that is starting gets none), and Ray brings the replica count back to two.

One cluster for the module; every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import jsonschema
import openai
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from graphserve.engine.config import EngineConfig
from graphserve.engine.sched.prefix_hash import prompt_keys
from graphserve.engine.tokenizer import Tokenizer
from graphserve.server.ray_app.app import (APP_NAME, RAY_SERVE_MODE, REPLICA_DEPLOYMENT, ROUTING_STATS_PERIOD_S, Scaling,
                                           graphserve_application)
from graphserve.server.ray_app.forwarded import ReplicaQuery
from graphserve.server.ray_app.ingress import REPLICA_HEADER
from graphserve.server.ray_app.routing_keys import CacheLayout, RoutingKeys
from graphserve.server.settings import ServerSettings
from live_server import free_port

# no warm-up burst before ready (8 s less for the module, start and restart): nothing here times a first request
ENGINE = EngineConfig(device="cpu", num_threads=1, max_model_len=1024, kv_cache_bytes=64 * 1024**2, max_num_seqs=8,
                      decode_chunk=2, warm_up=False)
TIMEOUT_S = 60.0
RECOVERY_S = 60.0  # the bound: served by two replicas again within 60 s of the kill
REPLICA = REPLICA_HEADER.decode()


@dataclass
class Endpoint:
    url: str
    model: str

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Endpoint]:
    # Ray's processes in the mode `graphserve serve --ray` gives a Ray of its own (ray_app/app.py); they take it
    # from this process's environment when the cluster starts
    saved = {name: os.environ.get(name) for name in RAY_SERVE_MODE}
    os.environ.update(RAY_SERVE_MODE)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        serve.run(graphserve_application(ServerSettings(), ENGINE, Scaling(replicas=2)), name=APP_NAME,
                  route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        yield Endpoint(url, model)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def replica_statuses() -> list:
    """Each running replica's status, reached in turn (ReplicaQuery excludes the ones already seen)."""
    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=APP_NAME)
    seen: dict[str, object] = {}
    while True:
        status = handle.replica_status.remote(ReplicaQuery(frozenset(seen))).result(timeout_s=TIMEOUT_S)
        if status.replica_id in seen:  # every replica excluded: the router let one answer again
            return list(seen.values())
        seen[status.replica_id] = status


def test_two_replicas_run_on_the_two_nodes(endpoint):
    statuses = replica_statuses()
    assert len(statuses) == 2
    assert len({s.node_id for s in statuses}) == 2
    assert all(s.status == "ok" for s in statuses)


def test_the_openai_client_streams_chat_through_the_ray_endpoint(endpoint):
    client = endpoint.openai()
    kw = dict(model=endpoint.model, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=16,
              temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_a_tool_call_and_a_structured_output_through_the_ray_endpoint(endpoint):
    client = endpoint.openai()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    called = client.chat.completions.create(
        model=endpoint.model, messages=[{"role": "user", "content": "What's the weather in Paris?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    person = client.chat.completions.create(
        model=endpoint.model, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert person.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(person.choices[0].message.content), PERSON)


def system_prompt(topic: str) -> str:
    return f"You are an assistant who only talks about {topic}. " * 12


def chat_body(system: str, user: str, **fields) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], **fields}


def test_the_router_sends_a_known_prefix_to_the_replica_that_holds_it(endpoint):
    wait_until_idle_reported()
    topics = ["rivers", "mountains", "violins", "comets"]
    served: dict[str, list[str]] = {t: [] for t in topics}
    cached: dict[str, list[int]] = {t: [] for t in topics}
    with httpx.Client(base_url=endpoint.url, timeout=TIMEOUT_S) as client:
        for question in ("Hello.", "Tell me more."):  # each prefix twice, the others in between
            for topic in topics:
                r = client.post("/v1/chat/completions", json=chat_body(system_prompt(topic), question, max_tokens=4))
                assert r.status_code == 200, r.text
                served[topic].append(r.headers[REPLICA])
                cached[topic].append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(first == second for first, second in served.values()), served
    assert len({first for first, _ in served.values()}) == 2, served  # new prefixes spread over both replicas
    prompt_blocks = len(system_prompt(topics[0]).split()) // 16  # a lower bound: a word is at least a token
    assert all(second >= 16 * prompt_blocks for _, second in cached.values()), cached


def test_the_ingress_keys_are_the_engines_block_keys_of_the_prompt_the_replica_renders(endpoint, tmp_path):
    """The router's keys (ray_app/routing_keys.py, from the tokenizer files and cache layout a replica reports)
    are the engine's prefix-cache keys of the prompt the replica builds (its /tokenize), block for block."""
    info = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=APP_NAME).routing_info.remote().result(
        timeout_s=TIMEOUT_S)
    for name, data in info.tokenizer_files.items():
        (tmp_path / name).write_bytes(data)
    keys = RoutingKeys(Tokenizer(tmp_path), CacheLayout(info.block_size, info.prefix_cache_root, info.base_models))
    body = chat_body(system_prompt("lighthouses"), "Hello.")
    tokens = httpx.post(endpoint.url + "/tokenize", json={"messages": body["messages"]}, timeout=TIMEOUT_S).json()[
        "tokens"]
    expected = tuple(prompt_keys(tokens, info.block_size, info.prefix_cache_root))
    assert len(expected) == (len(tokens) - 1) // info.block_size > 0
    assert keys.of("/v1/chat/completions", json.dumps(body).encode()) == expected
    assert keys.of("/v1/completions", json.dumps({"prompt": tokens}).encode()) == expected
    assert keys.of("/v1/chat/completions", b'{"messages": 3}') == ()  # the replica answers that one (400)
    # a LoRA adapter's KV differs: its prompts are keyed apart from the base model's, and from each other's
    named = {model: keys.of("/v1/chat/completions", json.dumps({**body, "model": model}).encode())
             for model in (endpoint.model, "adapter-a", "adapter-b")}
    assert named[endpoint.model] == expected
    assert len({named[endpoint.model][0], named["adapter-a"][0], named["adapter-b"][0]}) == 3


def test_a_client_that_leaves_mid_stream_has_its_engine_request_aborted(endpoint):
    body = chat_body(system_prompt("tides"), "Write a long story.", max_tokens=600, ignore_eos=True, stream=True)
    with httpx.Client(base_url=endpoint.url, timeout=TIMEOUT_S) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            next(events), next(events)
            wait_for_running(1)  # the engine's figures reach its replica at most every 0.1 s
    wait_for_running(0)  # within seconds: the engine would need most of a minute to finish the 600 tokens


def wait_until_idle_reported() -> None:
    """New prefixes go to the least loaded replica, by the queue and the KV use each reports every
    ROUTING_STATS_PERIOD_S: the earlier tests' requests must be gone from those reports too."""
    wait_for_running(0)
    time.sleep(2 * ROUTING_STATS_PERIOD_S)


def wait_for_running(count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (running := sum(s.stats.num_running for s in replica_statuses())) != count:
        assert time.monotonic() < deadline, f"{running} engine requests running, not {count}"
        time.sleep(0.1)


async def stream_chat(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> tuple[str, list]:
    """(the replica that served it, its events, parsed; [DONE] as the string)."""
    events: list = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None:
                    started.set()
        return r.headers[REPLICA], events


def test_killing_one_replicas_engine_fails_only_its_streams_and_ray_restarts_it(endpoint):
    before = {s.replica_id: s for s in replica_statuses()}
    assert len(before) == 2
    wait_until_idle_reported()  # the four new prefixes spread over both replicas

    async def scenario() -> tuple[list, str, list]:
        async with httpx.AsyncClient(base_url=endpoint.url, timeout=TIMEOUT_S) as client:
            streams = []
            for i in range(4):  # one at a time: each new prefix goes to the replica with fewer streams
                started = asyncio.Event()
                streams.append(asyncio.create_task(stream_chat(client, chat_body(
                    system_prompt(f"topic {i}"), "Write a long story.", max_tokens=120, ignore_eos=True), started)))
                await asyncio.wait_for(started.wait(), TIMEOUT_S)
            victim = next(iter(before))
            os.kill(before[victim].engine_core_pid, signal.SIGKILL)
            meanwhile = []
            for i in range(3):  # sent while the replica is dead, then while its replacement starts
                r = await client.post("/v1/chat/completions", json=chat_body(system_prompt("topic 0"), f"Hi {i}.",
                                                                               max_tokens=4))
                meanwhile.append((r.status_code, r.headers.get(REPLICA)))
            results = await asyncio.wait_for(asyncio.gather(*streams), TIMEOUT_S)  # none hangs
            return results, victim, meanwhile

    results, victim, meanwhile = asyncio.run(scenario())
    assert {replica for replica, _ in results} == set(before)  # both replicas had streams
    for replica, events in results:
        assert events[-1] == "[DONE]"
        if replica == victim:
            assert "error" in events[-2], events[-2]
        else:
            assert all("error" not in e for e in events[:-1])
            assert events[-2]["choices"][0]["finish_reason"] == "length"
    survivor = next(r for r in before if r != victim)
    assert meanwhile == [(200, survivor)] * 3

    deadline = time.monotonic() + RECOVERY_S
    while True:
        after = {s.replica_id: s for s in replica_statuses()}
        if len(after) == 2 and victim not in after and all(s.status == "ok" for s in after.values()):
            break
        assert time.monotonic() < deadline, f"not back to two replicas within {RECOVERY_S} s: {after}"
        time.sleep(1.0)
    with httpx.Client(base_url=endpoint.url, timeout=TIMEOUT_S) as client:
        r = client.post("/v1/chat/completions", json=chat_body(system_prompt("after"), "Hello.", max_tokens=4))
        assert r.status_code == 200
