"""Several served models through one API over real HTTP and a real Redis: each job lands on its
own model's lanes, an unknown model or adapter is 404 ``model_not_found`` (native and OpenAI
shapes), adapters are registered by admins and listed, and /v1/models counts each model's live workers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from tests.asgi_server import serve
from tests.conftest import RedisServer
from tidegate import adapter_registry, keys
from tidegate.adapter_registry import AdapterAnnouncement
from tidegate.jobstore import JOB_FIELD
from tidegate.producer.api import create_app
from tidegate.producer.submit.admission import Admission
from tidegate.protocol import Job
from tidegate.settings import Settings

pytestmark = pytest.mark.timeout(60)

MODELS = ["chat=random:tiny", "code=random:tiny"]
ADMIN, USER = "tg-admin-key", "tg-user-key"


@pytest.fixture(scope="module")
def models_api(redis_server: RedisServer, admission: Admission) -> Iterator[str]:
    settings = Settings(redis_url=redis_server.url, models=MODELS, api_keys=[USER],
                        admin_keys=[ADMIN])
    with serve(create_app(settings, admission=admission)) as url:
        yield url


@pytest.fixture
async def http(models_api: str, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=models_api, timeout=40,
                                 headers={"Authorization": f"Bearer {USER}"}) as client:
        yield client


async def queued(aredis: aioredis.Redis, model: str) -> list[Job]:
    entries = await aredis.xrange(keys.lane_stream(model, "interactive"))
    return [Job.model_validate_json(fields[JOB_FIELD]) for _, fields in entries]


async def heartbeat(aredis: aioredis.Redis, worker_id: str, model: str) -> None:
    await aredis.set(keys.worker_heartbeat(worker_id), json.dumps({"model": model}), ex=60)


async def test_each_job_goes_to_its_model_s_lane(http: httpx.AsyncClient,
                                                 aredis: aioredis.Redis) -> None:
    for model in (None, "chat", "tidegate", "random:tiny", "code"):
        body = {"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})}
        assert (await http.post("/v1/jobs", json=body)).status_code == 202
    chat, code = await queued(aredis, "chat"), await queued(aredis, "code")
    assert [j.model for j in chat] == ["chat"] * 4 and [j.model for j in code] == ["code"]
    assert all(j.adapter is None for j in chat + code)
    result = (await http.get(f"/v1/jobs/{code[0].id}")).json()
    assert (result["model"], result["adapter"]) == ("code", None)


async def test_an_unknown_model_is_404_naming_the_field_native_and_openai(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    r = await http.post("/v1/jobs", json={"prompt": "hi", "model": "gpt-4o"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["type"] == "model_not_found" and error["fields"][0]["field"] == "model"
    assert "chat, code" in error["message"]
    r = await http.post("/v1/chat/completions", json={
        "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": r.json()["error"]["message"], "type": "not_found_error", "param": "model",
        "code": "model_not_found"}
    r = await http.post("/v1/completions", json={"model": "chat:nope", "prompt": "hi"})
    assert (r.status_code, r.json()["error"]["param"]) == (404, "model")
    assert await aredis.dbsize() == 0


async def test_adapters_resolve_from_the_registry_else_404(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    r = await http.post("/v1/jobs", json={"prompt": "hi", "model": "chat", "lora": "sql"})
    assert r.status_code == 404
    assert r.json()["error"]["fields"][0]["field"] == "lora" and "'sql'" in r.text
    await adapter_registry.register(aredis, "chat", "sql", "/adapters/sql")
    await asyncio.sleep(1.1)  # the API's registry cache
    for body in ({"model": "chat:sql"}, {"model": "chat", "lora": "sql"}, {"lora": "sql"},
                 {"model": "random:tiny:sql", "lora": "sql"}):
        r = await http.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 202, (body, r.text)
    assert [(j.model, j.adapter) for j in await queued(aredis, "chat")] == [("chat", "sql")] * 4
    r = await http.post("/v1/jobs", json={"prompt": "hi", "model": "code:sql"})
    assert r.status_code == 404 and r.json()["error"]["fields"][0]["field"] == "model"


async def test_a_lora_that_disagrees_with_the_model_suffix_is_422(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    r = await http.post("/v1/jobs", json={"prompt": "hi", "model": "chat:sql", "lora": "py"})
    assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "lora"
    r = await http.post("/v1/jobs", json={"prompt": "hi", "lora": "bad name"})
    assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "lora"


async def test_v1_models_lists_served_models_with_their_live_workers_and_adapters(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    def listed(cards: list[dict]) -> list[tuple[str, str | None, int]]:
        return [(c["id"], c.get("parent"), c["live_workers"]) for c in cards]

    # Served models are listed before any worker comes: 0 live workers says their jobs wait.
    cards = (await http.get("/v1/models")).json()["data"]
    assert listed(cards) == [("chat", None, 0), ("code", None, 0)]
    await heartbeat(aredis, "w1", "code")
    await adapter_registry.register(aredis, "code", "py", "/adapters/py")
    await adapter_registry.register(aredis, "chat", "sql", "/adapters/sql")
    cards = (await http.get("/v1/models")).json()["data"]
    assert listed(cards) == [("chat", None, 0), ("chat:sql", "chat", 0), ("code", None, 1),
                             ("code:py", "code", 1)]
    await heartbeat(aredis, "w2", "chat")
    await heartbeat(aredis, "w3", "chat")
    cards = (await http.get("/v1/models")).json()["data"]
    assert [c["live_workers"] for c in cards] == [2, 2, 1, 1]
    assert (await http.get("/v1/models/tidegate")).json()["live_workers"] == 2
    for name, expected in (("tidegate", "chat"), ("code", "code"), ("chat:sql", "chat:sql")):
        assert (await http.get(f"/v1/models/{name}")).json()["id"] == expected
    # A model answers without a live worker.
    await aredis.delete(keys.worker_heartbeat("w2"), keys.worker_heartbeat("w3"))
    card = (await http.get("/v1/models/chat:sql")).json()
    assert (card["parent"], card["live_workers"]) == ("chat", 0)
    for missing in ("gpt-4o", "chat:nope", "nope:sql"):
        r = await http.get(f"/v1/models/{missing}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------- POST /v1/adapters


async def fake_worker(aredis: aioredis.Redis, worker_id: str, model: str,
                      outcome: str) -> None:
    """A worker of ``model`` that answers every announcement of its model with ``outcome``."""
    await heartbeat(aredis, worker_id, model)
    pubsub = aredis.pubsub()
    await pubsub.subscribe(keys.ADAPTER_CHANNEL)
    try:
        while True:
            msg = await pubsub.get_message(timeout=1.0)
            if msg and msg["type"] == "message":
                note = AdapterAnnouncement.model_validate_json(msg["data"])
                if note.model == model:
                    await aredis.hset(keys.adapter_loads(model),
                                      keys.adapter_load_field(note.name, worker_id), outcome)
    finally:
        await pubsub.aclose()


async def post_adapter(http: httpx.AsyncClient, key: str = ADMIN, **body: str) -> httpx.Response:
    return await http.post("/v1/adapters", json=body,
                           headers={"Authorization": f"Bearer {key}"})


async def test_only_admins_register_adapters(http: httpx.AsyncClient,
                                             aredis: aioredis.Redis) -> None:
    r = await post_adapter(http, USER, model="chat", name="sql", path="/a/sql")
    assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden"
    assert "admin key" in r.json()["error"]["message"]
    r = await post_adapter(http, "nobody", model="chat", name="sql", path="/a/sql")
    assert r.status_code == 401
    assert not await aredis.exists(keys.adapters("chat"))


async def test_no_live_worker_registers_it_for_later(http: httpx.AsyncClient,
                                                     aredis: aioredis.Redis) -> None:
    r = await post_adapter(http, model="tidegate", name="sql", path="/a/sql")
    assert r.status_code == 202 and r.json() == {"model": "chat", "name": "sql",
                                                 "path": "/a/sql", "status": "registered"}
    listed = (await http.get("/v1/adapters")).json()["models"]
    assert [(m["model"], [a["name"] for a in m["adapters"]]) for m in listed] == [
        ("chat", ["sql"]), ("code", [])]
    assert (await post_adapter(http, model="chat", name="sql", path="/a/sql")).status_code == 202
    r = await post_adapter(http, model="chat", name="sql", path="/elsewhere")
    assert r.status_code == 409 and r.json()["error"]["fields"][0]["field"] == "name"
    r = await post_adapter(http, model="gpt-4o", name="sql", path="/a/sql")
    assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"
    r = await post_adapter(http, model="chat", name="bad name", path="/a/sql")
    assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "name"


async def test_a_live_worker_s_load_answers_201_or_422(http: httpx.AsyncClient,
                                                       aredis: aioredis.Redis) -> None:
    ok = asyncio.create_task(fake_worker(aredis, "w-ok", "chat", "ok"))
    bad = asyncio.create_task(fake_worker(aredis, "w-bad", "code", "error: not a PEFT dir"))
    try:
        await asyncio.sleep(0.3)  # subscribed
        r = await post_adapter(http, model="chat", name="sql", path="/a/sql")
        assert r.status_code == 201, r.text
        assert r.json() == {"model": "chat", "name": "sql", "path": "/a/sql",
                            "status": "loaded", "loaded_by": ["w-ok"]}
        r = await post_adapter(http, model="code", name="py", path="/nowhere")
        assert r.status_code == 422
        assert r.json()["error"]["fields"] == [{"field": "path", "reason": "not a PEFT dir"}]
        assert await adapter_registry.registered(aredis, "code") == {}  # withdrawn
    finally:
        ok.cancel()
        bad.cancel()
        await asyncio.gather(ok, bad, return_exceptions=True)
