"""Which models `tokenmill serve` serves: repeated --model, a models file (YAML or JSON) whose entries take any
engine option and default to the command line's, names and aliases, and the one-line errors for bad ones."""
from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.entrypoints.cli import build_parser, main
from tokenmill.entrypoints.openai.model_specs import SpecReader, model_specs, with_lora_modules
from tokenmill.errors import InvalidRequestError
from tokenmill.metrics.prometheus import PrometheusStatLogger, ServerMetrics, render_together
from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_repeated_model_flags_serve_each_under_its_file_name(tmp_path):
    gguf, directory = tmp_path / "small.Q4_0.gguf", tmp_path / "llama-dir"
    args = serve_args("--model", str(gguf), "--model", str(directory), "--kv-cache-memory-bytes", "1GiB")
    specs = model_specs(args, None)
    assert [spec.name for spec in specs] == ["small.Q4_0", "llama-dir"]
    assert [spec.config.model for spec in specs] == [str(gguf), str(directory)]
    # The command line's engine flags are every model's; the name is pinned so the engine answers under it.
    assert {spec.config.kv_cache_memory_bytes for spec in specs} == {1024**3}
    assert [spec.config.served_model_name for spec in specs] == ["small.Q4_0", "llama-dir"]
    assert [spec.name for spec in model_specs(serve_args(), None)] == ["SmolLM2-135M-Instruct"]


def test_models_file_entries_take_engine_options_names_aliases_and_lazy_loading(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("""
models:
  - model: /models/a
    served_model_name: [alpha, first]   # vLLM's list: the first answers, the rest are aliases
    aliases: [a]
    kv-cache-memory-bytes: 64MiB
    enable_lora: true
    lora_modules: ["x=/adapters/x"]
  - model: /models/b.gguf
    load: false
    numerics: exact
    max_num_seqs: 8
""")
    specs = model_specs(serve_args("--max-num-seqs", "32", "--models-config", str(path)), str(path))
    alpha, beta = specs
    assert (alpha.name, alpha.aliases, alpha.load_at_start) == ("alpha", ("first", "a"), True)
    assert alpha.config.kv_cache_memory_bytes == 64 * 2**20 and alpha.config.enable_lora
    assert alpha.config.max_num_seqs == 32  # the command line's default
    assert alpha.lora_modules == ("x=/adapters/x",)
    assert (beta.name, beta.load_at_start, beta.config.numerics, beta.config.max_num_seqs) == ("b", False, "exact", 8)

    as_json = tmp_path / "models.json"
    as_json.write_text(json.dumps([{"model": "/models/c", "served_model_name": "c"}]))
    assert [spec.name for spec in model_specs(serve_args("--model", "/models/d"), str(as_json))] == ["d", "c"]


@pytest.mark.parametrize("entries, message", [
    ([{"model": "/m/a"}, {"model": "/n/a"}], "used twice"),
    ([{"model": "/m/a", "aliases": ["b"]}, {"model": "/m/b"}], "used twice"),
    ([{"model": "/m/a", "kv_cache_memry_bytes": "1GiB"}], "unknown engine option kv_cache_memry_bytes"),
    ([{"model": "/m/a", "max_num_seqs": "many"}], "'/m/a': argument --max-num-seqs: expected a positive integer"),
    ([{"model": "/m/a", "load": False}], "at least one model must load"),
    ([{"model": "/m/a", "load": "no"}], "load must be true or false"),
    ({"nothing": []}, "must list models"),
])
def test_bad_models_files_are_refused_with_the_reason(tmp_path, entries, message):
    path = tmp_path / "models.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(InvalidRequestError, match=message):
        model_specs(serve_args(), str(path))


def test_bad_server_model_settings_are_one_line_cli_errors(tmp_path, caplog):
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: [model: {")
    assert main(["serve", "--models-config", str(broken)]) == 2
    assert main(["serve", "--model", "/m/a", "--model", "/m/b", "--served-model-name", "x"]) == 2
    assert main(["serve", "--model", "/m/a", "--model", "/m/b", "--api-server-count", "2"]) == 2
    errors = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert len(errors) == 3 and all("\n" not in error for error in errors)
    assert "not valid YAML: expected the node content, but found '<stream end>' at line 1" in errors[0]
    assert "names one model" in errors[1] and "serves one model" in errors[2]


def test_lora_modules_go_to_the_model_their_base_model_name_names():
    specs = model_specs(serve_args("--model", "/m/a", "--model", "/m/b"), None)
    specs = with_lora_modules(specs, ("x=/adapters/x", '{"name": "y", "path": "/adapters/y", "base_model_name": "b"}'))
    assert [spec.lora_modules for spec in specs] == [("x=/adapters/x",), ('{"name": "y", "path": "/adapters/y", '
                                                                         '"base_model_name": "b"}',)]
    with pytest.raises(InvalidRequestError, match="no model is named 'c'"):
        with_lora_modules(specs, ('{"name": "z", "path": "/p", "base_model_name": "c"}',))


def test_an_admin_load_request_reads_like_a_models_file_entry():
    reader = SpecReader(serve_args("--numerics", "exact"))
    spec = reader.spec({"model": "/m/new.gguf", "served_model_name": "new", "data_parallel_size": 2})
    assert (spec.name, spec.config.data_parallel_size, spec.config.numerics) == ("new", 2, "exact")
    with pytest.raises(InvalidRequestError, match="aliases and lora_modules are lists"):
        reader.spec({"model": "/m/x", "aliases": "one"})


def test_metrics_of_several_models_render_as_one_exposition_with_each_family_once():
    loggers = [PrometheusStatLogger(name) for name in ("alpha", "beta")]
    loggers[1].record(SchedulerSnapshot(num_running=3), IterationStats())
    server = ServerMetrics()
    server.record_responses({"/v1/completions POST 2xx": 2})
    text = render_together([server.registry, *(logger.registry for logger in loggers)]).decode()
    families = list(text_string_to_metric_families(text))  # the parser refuses a family named twice
    names = [family.name for family in families]
    assert len(names) == len(set(names))
    running = next(f for f in families if f.name == "tokenmill:num_requests_running")
    assert {s.labels["model_name"]: s.value for s in running.samples} == {"alpha": 0.0, "beta": 3.0}
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 2.0' in text
    assert [line.split()[0] for line in text.splitlines()].count("process_resident_memory_bytes") == 1


def test_one_model_of_serve_reads_as_one_engine_config_and_several_do_not():
    from tokenmill.entrypoints.engine_args import engine_config_from_args

    assert engine_config_from_args(serve_args("--model", "/m/a.gguf")).model == "/m/a.gguf"
    with pytest.raises(InvalidRequestError, match="several --model flags"):
        engine_config_from_args(serve_args("--model", "/m/a", "--model", "/m/b"))
