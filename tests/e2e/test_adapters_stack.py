"""LoRA adapters through real processes: a worker started with ``--lora`` on a tiny random Llama
(an HF directory), an API with an admin key, a real redis-server. An admin registers a second
adapter at run time, jobs run on ``base:NAME`` and with ``lora``, each adapter changing the
output, and what is wrong is refused: a non-admin (403), a directory that is no adapter (422),
an unknown adapter (404)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import torch
from peft import LoraConfig, get_peft_model

from tests.conftest import RedisServer, free_port
from tests.e2e.test_models_stack import api_ready, start, stop, wait_until
from tests.worker.tiny_checkpoints import tiny_hf_model, write_hf_dir
from tidegate import adapter_registry, keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              # peft calls transformers' deprecated is_gradient_checkpointing: theirs, not ours.
              pytest.mark.filterwarnings("ignore::FutureWarning")]

ADMIN, USER = "tg-admin-stack", "tg-user-stack"
ADAPTERS = {"sql": ("q_proj", "v_proj"), "py": ("gate_proj", "up_proj", "down_proj"),
            "late": ("o_proj",)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base model as an HF directory, one PEFT directory per adapter, and a directory
    that is no adapter."""
    root = tmp_path_factory.mktemp("adapters")
    write_hf_dir(tiny_hf_model(tied=False), root / "base")
    for seed, (name, targets) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(seed)
        peft_model = get_peft_model(tiny_hf_model(tied=False), LoraConfig(
            r=8, lora_alpha=16, target_modules=list(targets), init_lora_weights=False))
        with torch.no_grad():  # PEFT's random init is small: make the adapters matter
            for pname, param in peft_model.named_parameters():
                if "lora_" in pname:
                    param.normal_(0.0, 0.3)
        peft_model.save_pretrained(root / name)
    (root / "not-an-adapter").mkdir()
    (root / "not-an-adapter" / "README").write_text("nothing here")
    return root


@pytest.fixture
def stack(redis_server: RedisServer, checkpoints: Path) -> Iterator[tuple[str, str, str]]:
    """API + one worker (with ``--lora sql=...``): (base URL, Redis URL, worker id)."""
    redis_server.flush()
    url, port = redis_server.url, free_port()
    model = f"base={checkpoints / 'base'}"
    env = {"TIDEGATE_API_KEYS": USER, "TIDEGATE_ADMIN_KEYS": ADMIN}
    api = start("api", "--model", model, "--port", str(port), url=url, **env)
    worker = start("worker", "--model", model, "--lora", f"sql={checkpoints / 'sql'}",
                   "--max-lora-rank", "8", url=url)
    base = f"http://127.0.0.1:{port}"
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        def up() -> bool:
            return bool(list(client.scan_iter(match=keys.worker_heartbeat("*")))) and \
                api_ready(base)

        wait_until(lambda: up() or api.poll() is not None or worker.poll() is not None,
                   "the API and the worker")
        for proc in (api, worker):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        [key] = client.scan_iter(match=keys.worker_heartbeat("*"))
        yield base, url, key.split("{", 1)[1].rstrip("}")
    finally:
        stop(worker)
        stop(api)
        client.close()


async def generate(http: httpx.AsyncClient, **body: object) -> dict:
    r = await http.post("/v1/jobs", json={"prompt": "abcdefgh", "max_tokens": 12,
                                          "ignore_eos": True, **body})
    assert r.status_code == 202, r.text
    job_id, deadline = r.json()["id"], time.monotonic() + 60
    while (result := (await http.get(f"/v1/jobs/{job_id}")).json())["status"] in (
            "queued", "running"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert result["status"] == "done", result
    return result


async def test_adapters_register_load_and_change_the_output(
        stack: tuple[str, str, str], checkpoints: Path) -> None:
    base, url, worker_id = stack
    user = {"Authorization": f"Bearer {USER}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=base, timeout=60, headers=user) as http:
        # --lora registered its adapter for the API too.
        listed = (await http.get("/v1/adapters")).json()["models"]
        assert [(m["model"], [a["name"] for a in m["adapters"]]) for m in listed] == [
            ("base", ["sql"])]
        body = {"model": "base", "name": "py", "path": str(checkpoints / "py")}
        r = await http.post("/v1/adapters", json=body)
        assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden"
        r = await http.post("/v1/adapters", json=body, headers=admin)
        assert r.status_code == 201, r.text
        assert r.json()["loaded_by"] == [worker_id]
        r = await http.post("/v1/adapters", headers=admin, json={
            "model": "base", "name": "broken", "path": str(checkpoints / "not-an-adapter")})
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "path"
        r = await http.post("/v1/adapters", headers=admin, json={
            "model": "nope", "name": "x", "path": str(checkpoints / "py")})
        assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"

        plain = (await generate(http))["text"]
        sql = await generate(http, model="base:sql")
        assert sql["adapter"] == "sql" and sql["text"] != plain
        py = await generate(http, model="base", lora="py")
        assert py["text"] not in (plain, sql["text"])
        assert (await generate(http, model="base:py", lora="py"))["text"] == py["text"]

        ids = [c["id"] for c in (await http.get("/v1/models")).json()["data"]]
        assert ids == ["base", "base:py", "base:sql"]
        r = await http.post("/v1/chat/completions", json={
            "model": "base:sql", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == "base:sql"
        for body in ({"model": "base:nope"}, {"lora": "broken"}):
            r = await http.post("/v1/jobs", json={"prompt": "hi", **body})
            assert r.status_code == 404 and "model_not_found" in r.text

    # Registered behind the workers' backs (no announcement): the first job loads it.
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    try:
        await adapter_registry.register(client, "base", "late", str(checkpoints / "late"))
        await asyncio.sleep(1.1)  # the API's registry cache
        async with httpx.AsyncClient(base_url=base, timeout=60, headers=user) as http:
            late = await generate(http, lora="late")
        assert late["text"] not in (plain, sql["text"], py["text"])
        beat = json.loads(await client.get(keys.worker_heartbeat(worker_id)) or "{}")
        deadline = time.monotonic() + 10
        while set(beat.get("adapters", [])) != {"sql", "py", "late"}:
            assert time.monotonic() < deadline, beat
            await asyncio.sleep(0.5)
            beat = json.loads(await client.get(keys.worker_heartbeat(worker_id)) or "{}")
        assert beat["model"] == "base"
    finally:
        await client.aclose()
