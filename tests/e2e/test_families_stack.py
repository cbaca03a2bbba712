"""Other families through the whole stack: `tidegate up --model` on a Gemma 2 directory (sliding
window, soft-capping, sandwich norms) and on a Qwen3-MoE GGUF (routed experts), a job submitted
with the Python client as a backend service would, its streamed and stored text equal to
transformers' greedy continuation of the same prompt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.conftest import RedisServer
from tests.stack_process import tidegate_up
from tests.worker.hf_oracle import hf_greedy
from tests.worker.models.family_checkpoints import write_family, write_family_gguf
from tidegate.producer.client import Client

pytestmark = pytest.mark.slow

PROMPT = "The tide gate opens at dawn"
NEW_TOKENS = 16


@pytest.mark.parametrize("kind", ["gemma2-directory", "qwen3_moe-gguf"])
def test_a_family_serves_through_the_stack(redis_server: RedisServer, tmp_path: Path,
                                           kind: str) -> None:
    name, form = kind.split("-")
    hf_model, hf_dir = write_family(name, tmp_path / "hf", **(
        {"norm_topk_prob": True} if form == "gguf" else {}))
    model = str(hf_dir if form == "directory"
                else write_family_gguf(name, hf_model, hf_dir, tmp_path / "m.gguf"))
    ids = [256, *PROMPT.encode()]  # the byte-level vocabulary: bos, then one id per byte
    config = hf_model.generation_config
    config.eos_token_id = None  # run the whole budget on both sides
    with torch.inference_mode():
        want = bytes(t for t in hf_greedy(ids, NEW_TOKENS, hf_model) if t < 256)

    async def run(url: str) -> tuple[str, str, int]:
        async with Client(url) as client:
            handle = await client.submit(PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                         ignore_eos=True)
            streamed = "".join([e.text async for e in handle.events() if e.type == "token"])
            result = await handle.result()
            assert result.status == "done" and result.usage is not None
            return streamed, result.text or "", result.usage.completion_tokens

    with tidegate_up(redis_server, model=model) as url:
        streamed, text, produced = asyncio.run(asyncio.wait_for(run(url), 120))
    assert produced == NEW_TOKENS
    assert streamed == text == want.decode("utf-8", errors="replace")
