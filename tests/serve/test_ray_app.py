"""tokenmill as a Ray Serve application: two engine replicas of the embedded model on a local Ray
instance, reached through the `openai` client; prompts sharing a prefix land on one replica.

Needs the optional `ray` extra (`pip install -e '.[ray]'`); without it this module is skipped.
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import tokenmill  # noqa: E402
from proc_util import descendants, free_port, still_alive  # noqa: E402
from tokenmill.serve.ray_app import REPLICA_HEADER, build_app  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "SmolLM2-135M-Instruct"
REPLICA = REPLICA_HEADER.decode()
# ~20 blocks of 16 tokens shared by every request that starts with it.
SYSTEM_A = ("You are the archivist of a small mountain library. You answer questions about its catalogue, "
            "its opening hours, the rules for borrowing rare maps, and the history of the valley. ") * 4
SYSTEM_B = ("You are a ship's navigator on a cargo vessel crossing the northern sea. You answer questions "
            "about tides, star sightings, the cargo manifest and the weather reports from the coast. ") * 4


@pytest.fixture(scope="module")
def base_url(smollm2_path):
    before = descendants(os.getpid())
    # Ray's workers import tokenmill from wherever this process did (a checkout or the installed package).
    src = str(Path(tokenmill.__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    started = set()
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({"model": str(smollm2_path), "replicas": "2", "kv_cache_memory_bytes": "48M",
                         "max_model_len": "1024", "max_num_seqs": "8", "disable_log_stats": "true",
                         "disable_log_requests": "true", "log_level": "WARNING"})
        serve.run(app, name="tokenmill", route_prefix="/", blocking=False)
        started = descendants(os.getpid()) - before
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        started |= descendants(os.getpid()) - before
        serve.shutdown()
        ray.shutdown()
        leaked = still_alive(started, 30)
        assert not leaked, f"processes left after ray.shutdown(): {leaked}"


@pytest.fixture
def client(base_url):
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


async def _chat(client, system: str, question: str, max_tokens: int = 8) -> tuple[str, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    reply = raw.parse()
    assert reply.choices[0].finish_reason in ("stop", "length")
    return raw.headers[REPLICA], reply.choices[0].message.content


async def _stream(client, question: str) -> tuple[str, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": question}])
    pieces, usage, finish = [], None, None
    async for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish in ("stop", "length") and usage is not None and usage.completion_tokens >= 1
    assert len([p for p in pieces if p]) >= 2  # streamed in pieces, not one block
    return raw.headers[REPLICA], "".join(pieces)


def test_concurrent_chat_and_streaming_answers(client):
    async def run():
        questions = ["What is the capital of France?", "Name a primary colour.", "What is two plus two?"]
        return await asyncio.gather(*(_chat(client, "You are a helpful assistant.", q) for q in questions),
                                    *(_stream(client, q) for q in questions[:2]))

    results = asyncio.run(run())
    for replica, text in results:
        assert replica and text.strip()


def test_prompts_sharing_a_prefix_land_on_one_replica(client):
    async def run():
        first, _ = await _chat(client, SYSTEM_A, "When does the library open?")
        followers = await asyncio.gather(*(_chat(client, SYSTEM_A, q) for q in (
            "May I borrow a map?", "Who founded the library?", "Is there a reading room?")))
        # A new prefix while the replicas are equally idle: the replica with the least remembered goes.
        other, _ = await _chat(client, SYSTEM_B, "How high is the tide tonight?")
        other_followers = await asyncio.gather(*(_chat(client, SYSTEM_B, q) for q in (
            "Which star do we steer by?", "What is in the hold?")))
        again, _ = await _chat(client, SYSTEM_A, "Are dogs allowed inside?")
        return first, [r for r, _ in followers], other, [r for r, _ in other_followers], again

    first, followers, other, other_followers, again = asyncio.run(run())
    assert followers == [first] * 3 and again == first
    assert other != first and other_followers == [other] * 2


def test_completions_and_errors_pass_through(client, base_url):
    async def run():
        reply = await client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
        assert reply.choices[0].text
        with pytest.raises(openai.BadRequestError) as err:  # the replica's own validation and error body
            await client.completions.create(model=MODEL, prompt="Hello", max_tokens=5000)
        assert "context length" in str(err.value)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

    asyncio.run(run())
