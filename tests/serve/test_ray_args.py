"""The Ray Serve application's arguments (`serve run tokenmill.serve.ray_app:build_app key=value ...`)."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from tokenmill.serve.ray_app import autoscaling_config, build_app, parse_server_args, split_args  # noqa: E402


def test_app_arguments_and_server_flags_are_told_apart():
    app, argv = split_args({"replicas": "2", "model": "/m.gguf", "max-num-seqs": 8, "enable_prefix_caching": "false",
                            "disable_log_stats": True, "api_key": ["k1", "k2"], "max_imbalance": "3"})
    assert app == {"replicas": 2, "max_imbalance": 3}
    assert argv == ["--model", "/m.gguf", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                    "--disable-log-stats", "--api-key", "k1", "--api-key", "k2"]
    args = parse_server_args(argv)
    assert args.max_num_seqs == 8 and args.enable_prefix_caching is False and args.api_key == ["k1", "k2"]


@pytest.mark.parametrize("bad", [{"no_such_flag": "1"}, {"replicas": "two"}, {"max_num_seqs": "-1"},
                                 {"enable_prefix_caching": "maybe"}])
def test_bad_arguments_fail_before_any_replica_starts(bad):
    with pytest.raises(ValueError):
        parse_server_args(split_args(bad)[1])


def test_autoscaling_only_when_asked_for_and_within_its_bounds():
    assert autoscaling_config({}, 2, 64) is None
    assert autoscaling_config({"min_replicas": 1, "max_replicas": 4}, 2, 64) == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 2, "target_ongoing_requests": 32.0}
    asked = autoscaling_config({"max_replicas": 4, "target_ongoing_requests": 5.0}, 1, 64)
    assert asked["target_ongoing_requests"] == 5.0 and asked["min_replicas"] == 1
    assert autoscaling_config({"min_replicas": 3}, 2, 64)["initial_replicas"] == 3
    with pytest.raises(ValueError):
        autoscaling_config({"min_replicas": 3, "max_replicas": 2}, 2, 64)


def test_max_replicas_per_node_spreads_both_deployments(smollm2_path):
    def per_node(app):
        front = app._bound_deployment
        engine = front.init_args[0]._bound_deployment
        return front._replica_config.max_replicas_per_node, engine._replica_config.max_replicas_per_node

    assert per_node(build_app({"model": str(smollm2_path), "replicas": "2"})) == (None, None)
    assert per_node(build_app({"model": str(smollm2_path), "replicas": "2", "max_replicas_per_node": "1"})) == (1, 1)
    with pytest.raises(ValueError):
        build_app({"model": str(smollm2_path), "max_replicas_per_node": "0"})


def test_long_prompt_lanes_reach_the_router_and_cap_the_replicas_steps(smollm2_path):
    def lanes(app):
        engine = app._bound_deployment.init_args[0]._bound_deployment
        argv = app._bound_deployment.init_args[1]  # the flags the front and every engine replica get
        return engine._deployment_config.request_router_config.request_router_kwargs, parse_server_args(argv)

    kwargs, args = lanes(build_app({"model": str(smollm2_path), "replicas": "3"}))
    assert kwargs["long_prompt_threshold"] is None and args.long_prefill_token_threshold is None
    kwargs, args = lanes(build_app({"model": str(smollm2_path), "replicas": "3", "long_prompt_threshold": "1000",
                                    "long_prompt_replicas": "2"}))
    assert (kwargs["long_prompt_threshold"], kwargs["long_prompt_replicas"]) == (1000, 2)
    assert args.long_prefill_token_threshold == 256
    _, args = lanes(build_app({"model": str(smollm2_path), "long_prompt_threshold": "1000",
                               "long_prefill_token_threshold": "512"}))
    assert args.long_prefill_token_threshold == 512  # the user's own cap stays
    kwargs, args = lanes(build_app({"model": str(smollm2_path), "long_prompt_threshold": "1000",
                                    "long_prompt_borrowing": "false"}))
    assert kwargs["long_prompt_borrowing"] is False and args.long_prefill_token_threshold is None
    with pytest.raises(ValueError):
        build_app({"model": str(smollm2_path), "long_prompt_threshold": "0"})
