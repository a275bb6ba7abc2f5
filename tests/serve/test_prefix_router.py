"""The Ray Serve request router's choices, on stand-ins for the replicas Ray Serve hands it: prefixes,
loads and the length-aware lanes (the policy `--data-parallel-size` uses, engine/dp_router.py)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

pytest.importorskip("ray.serve")

from ray.serve.request_router import ReplicaID  # noqa: E402

from tokenmill.serve.http_bridge import HttpRequest  # noqa: E402
from tokenmill.serve.prefix_router import PrefixAwareRequestRouter  # noqa: E402
from tokenmill.serve.routing import RoutedRequest  # noqa: E402


@dataclass
class Replica:
    replica_id: ReplicaID
    max_ongoing_requests: int = 100


@dataclass
class Pending:
    args: list
    kwargs: dict


class Result:
    def __init__(self) -> None:
        self.callbacks = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def finish(self) -> None:
        for callback in self.callbacks:
            callback(None)


class Router(PrefixAwareRequestRouter):
    _event_loop = None  # Ray Serve's router loop; the test's own here


def _router(loop, **kwargs) -> PrefixAwareRequestRouter:
    router = Router.__new__(Router)  # Ray Serve's own set-up (handles, metrics) is not needed
    router._event_loop = loop
    router.initialize_state(**kwargs)
    return router


def _request(num_prompt_tokens: int, first_block: bytes) -> Pending:
    return Pending([RoutedRequest(HttpRequest("POST", "/v1/completions"), [first_block], 100, num_prompt_tokens)], {})


def _route(router, replicas, pending, loop) -> tuple[ReplicaID, Result]:
    ranks = loop.run_until_complete(router.choose_replicas(replicas, pending))
    chosen = ranks[0][0].replica_id
    result = Result()
    router.on_request_routed(pending, chosen, result)
    return chosen, result


def test_long_prompts_take_the_last_replicas_and_borrow_a_short_one_when_theirs_are_busy():
    loop = asyncio.new_event_loop()
    try:
        ids = [ReplicaID(name, deployment_id=None) for name in ("r-a", "r-b", "r-c")]
        replicas = [Replica(replica_id) for replica_id in reversed(ids)]  # the lanes follow the ids, not this order
        router = _router(loop, long_prompt_threshold=100)
        shorts = [_route(router, replicas, _request(20, bytes([i])), loop) for i in range(4)]
        assert {chosen for chosen, _ in shorts} == {ids[0], ids[1]}  # never the long lane's replica
        first, first_result = _route(router, replicas, _request(500, b"L1"), loop)
        assert first == ids[2]
        # The long lane is busy: the next long prompts borrow the short replicas, one each, then queue.
        borrowed = [_route(router, replicas, _request(500, b"L" + bytes([i])), loop)[0] for i in (2, 3)]
        assert sorted(borrowed, key=lambda i: i.unique_id) == ids[:2]
        assert _route(router, replicas, _request(500, b"L4"), loop)[0] == ids[2]
        # The long lane's first prompt finishes: the next long prompt goes back to its own lane.
        first_result.finish()
        loop.run_until_complete(asyncio.sleep(0))
        assert router.long_in_flight[ids[2]] == 1
        assert _route(router, replicas, _request(500, b"L5"), loop)[0] == ids[2]
        # Without borrowing, long prompts stay in their lane.
        strict = _router(loop, long_prompt_threshold=100, long_prompt_borrowing=False)
        assert [_route(strict, replicas, _request(500, b"S" + bytes([i])), loop)[0] for i in range(3)] == [ids[2]] * 3
        # Without a threshold there are no lanes: a long prompt goes to the least loaded replica.
        plain = _router(loop)
        assert _route(plain, replicas, _request(500, b"X"), loop)[0] in ids
    finally:
        loop.close()
