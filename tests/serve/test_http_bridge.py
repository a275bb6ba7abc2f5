"""serve/http_bridge.py and serve/routing.py: no Ray needed (the Ray Serve app's plumbing)."""
from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from starlette.responses import StreamingResponse

from tokenmill.engine.dp_router import prompt_block_hashes
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.serve.http_bridge import HttpRequest, ResponseStart, call_app
from tokenmill.serve.routing import prompt_token_ids, routed_request


def _app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"body": (await request.json()), "query": request.url.query, "x": request.headers.get("x-k")}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():
            try:
                for i in range(100):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                events.append("stream closed")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


async def _collect(app, request: HttpRequest, limit: int | None = None) -> list:
    items = []
    gen = call_app(app, request)
    async for item in gen:
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    await gen.aclose()
    return items


def test_a_request_runs_through_the_app_with_body_query_and_headers():
    request = HttpRequest("POST", "/echo", b"a=1", [(b"content-type", b"application/json"), (b"x-k", b"v")],
                          json.dumps({"hello": "world"}).encode())
    start, *body = asyncio.run(_collect(_app([]), request))
    assert isinstance(start, ResponseStart) and start.status == 200
    assert (b"content-type", b"application/json") in start.headers
    assert json.loads(b"".join(body)) == {"body": {"hello": "world"}, "query": "a=1", "x": "v"}


def test_a_stream_arrives_in_chunks_and_a_reader_that_stops_ends_it():
    events: list[str] = []
    items = asyncio.run(_collect(_app(events), HttpRequest("GET", "/stream"), limit=4))
    assert isinstance(items[0], ResponseStart) and items[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert events == ["stream closed"]  # the app's generator was closed, not left running


def test_unknown_routes_answer_404_through_the_bridge():
    start, *_ = asyncio.run(_collect(_app([]), HttpRequest("GET", "/nowhere")))
    assert start.status == 404


def test_routing_hashes_the_prompt_the_replica_will_see(smollm2_tokenizer):
    processor = InputProcessor(smollm2_tokenizer, 2048, len(smollm2_tokenizer))
    messages = [{"role": "system", "content": "You keep a lighthouse. " * 10}, {"role": "user", "content": "Hi"}]
    chat = json.dumps({"model": "m", "messages": messages}).encode()
    ids = prompt_token_ids(processor, "/v1/chat/completions", chat)
    assert ids == processor.apply_chat_template(messages).prompt_token_ids
    routed = routed_request(HttpRequest("POST", "/v1/chat/completions", body=chat), processor, 16, 100)
    assert routed.block_hashes == prompt_block_hashes(ids, 16) and len(routed.block_hashes) >= 4
    assert routed.capacity_blocks == 100 and routed.num_prompt_tokens == len(ids)
    batch = json.dumps({"model": "m", "prompt": [[5] * 40, [6] * 40]}).encode()
    assert prompt_token_ids(processor, "/v1/completions", batch) == [5] * 40  # the first prompt places a batch
    # Bodies the replica will refuse, and endpoints without a prompt, route on load alone.
    assert prompt_token_ids(processor, "/v1/chat/completions", b"{not json") is None
    assert prompt_token_ids(processor, "/v1/completions", json.dumps({"model": "m"}).encode()) is None
    assert prompt_token_ids(processor, "/tokenize", chat) is None
    big = routed_request(HttpRequest("POST", "/v1/chat/completions", body=chat), processor, 16, 100,
                         max_body_bytes=10)
    assert big.block_hashes == []
