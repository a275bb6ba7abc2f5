"""`tokenmill plan`: how many devices a model needs to hold a given concurrency at a given context length.

    KV bytes/token  = 2 (K and V) × layers × KV heads × head_dim × KV dtype bytes   (int8: 1 B per value and a
                                                                                   float16 scale per 32 values)
    weights         = parameters × weight dtype bytes
    usable/device   = device memory × (1 − headroom)        headroom: activations, graphs, fragmentation, bursts
    KV/device       = usable/device − weights / TP
    TP              = the smallest power of two dividing the attention and KV heads whose shard of the weights
                      leaves room for one full sequence
    KV/sequence     = whole KV blocks of the context per layer; a sliding-window layer (Gemma 3's local ones)
                      holds only the blocks its window reaches, as the engine frees the ones behind it
    max concurrency = KV bytes per replica ÷ KV bytes per sequence
    replicas        = ⌈target concurrency ÷ per-replica concurrency⌉,  devices = replicas × TP

Under tensor parallelism each rank holds KV heads ÷ TP heads: tokenmill's `--tensor-parallel-size` splits
the attention and KV heads evenly (it refuses a size that does not divide them), so a plan only uses such sizes.
With a measured profile (a `bench sweep` JSON of the same model and device), the per-replica concurrency is
also capped where P95 TTFT crosses the target.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from tokenmill.core.kv_cache_groups import blocks_per_sequence
from tokenmill.errors import InvalidRequestError
from tokenmill.planning.gpus import DeviceSpec

# Bytes per value of what the engine holds: weights in float32/float16/bfloat16, or in blocks of 32 with a
# float16 scale each as the engine keeps them (int8: Q8_0, --quantization q8_0 or a Q8_0 GGUF, 8.5 bits; int4:
# a Q4_0 GGUF, 4.5 bits); KV caches in the float dtypes (int8 below). The engine serves no fp8 weights or cache.
DTYPE_BYTES: dict[str, float] = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1 + 2 / 32, "int4": 0.5 + 2 / 32}
# The KV cache dtypes the engine stores (--kv-cache-dtype); an int8 row carries a float16 scale per 32 values
# (model/layers/kv_int8.py's KV_INT8_GROUP and KV_INT8_SCALE_BYTES, kept torch-free here).
KV_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
KV_VALUE_BYTES: dict[str, float] = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
KV_INT8_GROUP = 32
KV_INT8_SCALE_BYTES = 2
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                  "q8_0": "int8", "q4_0": "int4"}
MAX_TENSOR_PARALLEL = 64
SCALE_OUT_WINDOW = "5 min"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    max_position_embeddings: Optional[int] = None
    default_dtype: str = "bfloat16"
    # Each layer's sliding window (None: full attention); empty: every layer attends to the whole context.
    layer_windows: tuple[Optional[int], ...] = ()

    def kv_bytes_per_token(self, dtype_bytes: float, row_extra_bytes: int = 0) -> int:
        """Every layer's K and V of one token. row_extra_bytes: bytes stored beside each (token, head) row's
        values (an int8 cache's scales)."""
        return int(2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + row_extra_bytes))

    def kv_bytes_per_sequence(self, length: int, block_size: int, dtype_bytes: float, row_extra_bytes: int = 0
                              ) -> int:
        """What one request of `length` tokens holds in the engine's paged cache: whole blocks, and in a
        sliding-window layer only the blocks its window still reaches (core/kv_cache_groups.py)."""
        windows = self.layer_windows or (None,) * self.num_layers
        per_layer_token = self.kv_bytes_per_token(dtype_bytes, row_extra_bytes) / self.num_layers
        blocks = blocks_per_sequence(windows, length, block_size)  # layer-blocks: one group per layer here
        return int(blocks * block_size * per_layer_token)

    def int8_kv_scale_bytes(self) -> int:
        return KV_INT8_SCALE_BYTES * -(-self.head_dim // KV_INT8_GROUP)


# Numbers from each model's published config.json and safetensors parameter count.
PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec("llama-3-8b", 32, 32, 8, 128, 8_030_261_248, 8192),
    ModelSpec("llama-3.1-8b", 32, 32, 8, 128, 8_030_261_248, 131072),
    ModelSpec("llama-3-70b", 80, 64, 8, 128, 70_553_706_496, 8192),
    ModelSpec("llama-3.1-70b", 80, 64, 8, 128, 70_553_706_496, 131072),
    ModelSpec("llama-2-7b", 32, 32, 32, 128, 6_738_415_616, 4096),
    ModelSpec("qwen2.5-7b", 28, 28, 4, 128, 7_615_616_512, 32768),
    ModelSpec("qwen2.5-72b", 80, 64, 8, 128, 72_706_203_648, 32768),
    ModelSpec("mistral-7b", 32, 32, 8, 128, 7_241_732_096, 32768),
    ModelSpec("smollm2-135m", 30, 9, 3, 64, 134_515_008, 8192),
    # Five sliding-window layers (512 tokens) to one global, whose KV the engine keeps for the window only.
    ModelSpec("gemma3-270m", 18, 4, 1, 256, 268_098_176, 32768,
              layer_windows=tuple(None if (layer + 1) % 6 == 0 else 512 for layer in range(18))),
)}


def normalize_dtype(dtype: str) -> str:
    dtype = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if dtype != "auto" and dtype not in DTYPE_BYTES:
        raise InvalidRequestError(f"{dtype!r} is not a format tokenmill serves; choose auto or one of "
                                  f"{', '.join(DTYPE_BYTES)} (int8: Q8_0 blocks, int4: Q4_0 blocks)")
    return dtype


# ---- model resolution --------------------------------------------------------------------------------
def resolve_model(model: str) -> ModelSpec:
    """A preset name, an HF model directory (config.json), or a .gguf file (or a directory holding one)."""
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return _from_hf_dir(path)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else [path] if path.suffix.lower() == ".gguf" else []
    if len(ggufs) == 1 and ggufs[0].is_file():
        return _from_gguf(ggufs[0])
    raise InvalidRequestError(f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) "
                              "nor a local HF directory with config.json or a .gguf file")


def _from_hf_dir(path: Path) -> ModelSpec:
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config = {**config, **(config.get("text_config") or {})}  # multimodal wrappers nest the LM's config
    try:
        heads = int(config["num_attention_heads"])
        spec = dict(num_layers=int(config["num_hidden_layers"]), num_attention_heads=heads,
                    num_kv_heads=int(config.get("num_key_value_heads") or heads),
                    head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{path}/config.json lacks {exc} (needs layers, heads, hidden size)") from None
    params = _safetensors_params(path) or estimate_params(config)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return ModelSpec(path.name, num_params=params, max_position_embeddings=config.get("max_position_embeddings"),
                     default_dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
                     layer_windows=_hf_layer_windows(path, config), **spec)


def _hf_layer_windows(path: Path, config: dict[str, Any]) -> tuple[Optional[int], ...]:
    """Sliding windows as the engine reads them (transformers' config, which fills in Gemma 3's layer
    pattern); () for a config with no `sliding_window` or one transformers does not know."""
    if not config.get("sliding_window"):
        return ()
    try:
        from transformers import AutoConfig

        loaded = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception:  # noqa: BLE001 - an architecture this transformers does not know: no windows
        return ()
    return _layer_windows(loaded.get_text_config())


def _safetensors_params(path: Path) -> Optional[int]:
    """Parameter count from the safetensors headers (8-byte length + JSON), without reading any weight."""
    total = 0
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        with file.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                total += math.prod(info["shape"])
    return total or None


def estimate_params(config: dict[str, Any]) -> int:
    """Llama-shaped count: embeddings, attention, gated MLP (× experts), norms, untied head."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads)
    vocab, layers = int(config.get("vocab_size") or 0), int(config["num_hidden_layers"])
    inter = int(config.get("intermediate_size") or 4 * hidden)
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 1)
    attention = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    per_layer = attention + 3 * hidden * inter * experts + 2 * hidden
    head = 0 if config.get("tie_word_embeddings") else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + head


def _from_gguf(path: Path) -> ModelSpec:
    from tokenmill.model import gguf_loader

    try:
        reader = gguf_loader.open_gguf(path)
        config, _ = gguf_loader.read_gguf_config(reader, path)
    except Exception as exc:  # the loader raises its own types for unsupported files
        raise InvalidRequestError(f"cannot read {path}: {exc}") from None
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelSpec(path.stem, int(config.num_hidden_layers), heads,
                     int(getattr(config, "num_key_value_heads", None) or heads), int(head_dim),
                     sum(int(t.n_elements) for t in reader.tensors), config.max_position_embeddings,
                     layer_windows=_layer_windows(config))


def _layer_windows(config: Any) -> tuple[Optional[int], ...]:
    """The engine's own reading of a transformers config's sliding windows; () when no layer has one."""
    from tokenmill.model.layers.decoder import layer_windows

    windows = layer_windows(config)
    return windows if any(window is not None for window in windows) else ()


# ---- the plan ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class PlanInputs:
    model: ModelSpec
    device: DeviceSpec
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    concurrency: Optional[int] = None
    headroom: float = 0.3
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    tensor_parallel_size: Optional[int] = None  # None: the smallest that fits
    target_ttft_ms: Optional[float] = None
    profile: Optional[dict[str, Any]] = None  # a `bench sweep` result
    profile_path: Optional[str] = None
    price_per_device_hour: Optional[float] = None  # what one device costs an hour (any currency)


def _check(inputs: PlanInputs) -> tuple[str, str, int]:
    if not 0.0 <= inputs.headroom < 1.0:
        raise InvalidRequestError("--headroom must be in [0, 1)")
    if inputs.concurrency is not None and inputs.concurrency < 1:
        raise InvalidRequestError("--concurrency must be at least 1")
    if inputs.block_size < 1:
        raise InvalidRequestError("--block-size must be at least 1")
    dtype = normalize_dtype(inputs.dtype)
    dtype = inputs.model.default_dtype if dtype == "auto" else dtype
    kv_dtype = _DTYPE_ALIASES.get(inputs.kv_cache_dtype.lower(), inputs.kv_cache_dtype.lower())
    if kv_dtype == "auto":  # the KV cache is kept in the activation dtype, never in a weight-only format
        kv_dtype = dtype if dtype in ("float32", "float16", "bfloat16") else "bfloat16"
    if kv_dtype not in KV_DTYPES:
        raise InvalidRequestError(f"--kv-cache-dtype must be one of {', '.join(KV_DTYPES)} (the caches the engine "
                                  f"stores), got {inputs.kv_cache_dtype!r}")
    length = inputs.max_model_len or inputs.model.max_position_embeddings
    if not length or length < 1:
        raise InvalidRequestError("give --max-model-len (the model's config has no max_position_embeddings)")
    return dtype, kv_dtype, int(length)


def replica_capacity(model: ModelSpec, device: DeviceSpec, tp: int, headroom: float, weight_bytes: float,
                     kv_token_bytes: int) -> tuple[float, float, int]:
    """(usable bytes per device, KV bytes per device, KV tokens per replica) at tensor-parallel size tp."""
    usable = device.memory_bytes * (1.0 - headroom)
    kv_per_device = usable - weight_bytes / tp
    tokens = int(kv_per_device // (kv_token_bytes / tp)) if kv_per_device > 0 else 0
    return usable, kv_per_device, tokens


def splits_heads(model: ModelSpec, tp: int) -> bool:
    """Whether `--tensor-parallel-size tp` can serve the model: both head counts divide evenly."""
    return model.num_attention_heads % tp == 0 and model.num_kv_heads % tp == 0


def choose_tensor_parallel(model: ModelSpec, device: DeviceSpec, headroom: float, weight_bytes: float,
                           kv_token_bytes: int, seq_bytes: int) -> int:
    tp = 1
    while tp <= MAX_TENSOR_PARALLEL:
        if splits_heads(model, tp):
            kv_per_device = replica_capacity(model, device, tp, headroom, weight_bytes, kv_token_bytes)[1]
            if kv_per_device >= seq_bytes / tp:
                return tp
        tp *= 2
    raise InvalidRequestError(f"{model.name} does not fit one full-length sequence on up to "
                              f"{MAX_TENSOR_PARALLEL} × {device.name} at headroom {inputs_pct(headroom)}")


def inputs_pct(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def make_plan(inputs: PlanInputs) -> dict[str, Any]:
    """The capacity plan as a JSON-ready dict (see the module docstring for the formulas)."""
    model, device = inputs.model, inputs.device
    dtype, kv_dtype, length = _check(inputs)
    weight_bytes = model.num_params * DTYPE_BYTES[dtype]
    scale_bytes = model.int8_kv_scale_bytes() if kv_dtype == "int8" else 0
    kv_token = model.kv_bytes_per_token(KV_VALUE_BYTES[kv_dtype], scale_bytes)
    seq_bytes = model.kv_bytes_per_sequence(length, inputs.block_size, KV_VALUE_BYTES[kv_dtype], scale_bytes)
    tp = inputs.tensor_parallel_size or choose_tensor_parallel(model, device, inputs.headroom, weight_bytes,
                                                               kv_token, seq_bytes)
    if not splits_heads(model, tp):
        raise InvalidRequestError(f"--tensor-parallel-size {tp} does not divide {model.name}'s "
                                  f"{model.num_attention_heads} attention and {model.num_kv_heads} KV heads")
    usable, kv_per_device, kv_tokens = replica_capacity(model, device, tp, inputs.headroom, weight_bytes, kv_token)
    # Each rank holds its share of the KV heads: a sequence costs it seq_bytes / tp.
    max_concurrency = int(kv_per_device // (seq_bytes / tp)) if kv_per_device > 0 else 0
    if max_concurrency < 1:
        raise InvalidRequestError(f"at tensor-parallel size {tp}, {device.name} has no room for one "
                                  f"{length}-token sequence of {model.name}")
    plan: dict[str, Any] = {
        "model": asdict(model), "device": asdict(device), "dtype": dtype, "kv_cache_dtype": kv_dtype,
        "max_model_len": length, "block_size": inputs.block_size, "headroom": inputs.headroom,
        "weights_bytes": weight_bytes, "kv_bytes_per_token": kv_token,
        "kv_bytes_per_sequence": seq_bytes, "usable_bytes_per_device": usable,
        "tensor_parallel_size": tp, "kv_bytes_per_device": kv_per_device, "kv_tokens_per_replica": kv_tokens,
        "max_concurrency_per_replica": max_concurrency,
        "decode_tok_s_ceiling_batch1": None if device.bandwidth_gbps is None
        else device.bandwidth_gbps * 1e9 / (weight_bytes / tp),
        "target_concurrency": inputs.concurrency, "target_ttft_ms": inputs.target_ttft_ms,
    }
    per_replica = max_concurrency
    if inputs.profile is not None and inputs.target_ttft_ms is not None:
        plan["profile"] = profile_crossing(inputs.profile, inputs.target_ttft_ms, inputs.profile_path)
        bound = plan["profile"]["ttft_bound_concurrency"]
        if bound is not None:
            per_replica = max(1, min(per_replica, int(bound)))
    plan["concurrency_per_replica"] = per_replica
    if inputs.concurrency is not None:
        replicas = math.ceil(inputs.concurrency / per_replica)
        plan.update(replicas_needed=replicas, devices_needed=replicas * tp)
    plan["scale_out_trigger"] = scale_out_trigger(plan)
    if inputs.price_per_device_hour is not None:
        plan["cost"] = plan_cost(plan, inputs.price_per_device_hour, inputs.profile)
    replicas = plan.get("replicas_needed") or 1
    plan["serve_flags"] = (f"--max-model-len {length} --max-num-seqs {per_replica} "
                           f"--gpu-memory-utilization {1.0 - inputs.headroom:g}"
                           + (f" --tensor-parallel-size {tp}" if tp > 1 else "")
                           # Replicas on one machine run as data-parallel engine cores behind one server.
                           + (f" --data-parallel-size {replicas}" if replicas > 1 else ""))
    return plan


def _interpolate(points: list[tuple[float, float]], target: float) -> Optional[float]:
    """x where y first rises through target, linear between measured points; None if it never does."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y0 <= target < y1:
            return x0 + (target - y0) * (x1 - x0) / (y1 - y0)
    return None


def profile_crossing(profile: dict[str, Any], target_ms: float, path: Optional[str] = None) -> dict[str, Any]:
    """Where the measured P95 TTFT crosses the target, interpolating between sweep points."""
    points = [p for p in profile.get("points", []) if p.get("max_concurrency") and p.get("p95_ttft_ms") is not None]
    if not points:
        raise InvalidRequestError("the --profile has no points with max_concurrency and p95_ttft_ms "
                                  "(make one with `tokenmill bench sweep`)")
    points.sort(key=lambda p: p["max_concurrency"])
    ttft = [(float(p["max_concurrency"]), float(p["p95_ttft_ms"])) for p in points]
    out: dict[str, Any] = {"path": path, "measured": [{"concurrency": c, "p95_ttft_ms": t} for c, t in ttft],
                           "crossing_concurrency": None, "ttft_bound_concurrency": None}
    if ttft[0][1] > target_ms:
        # The crossing lies below every measured point: plan one request per replica and say so.
        out["status"] = (f"P95 TTFT exceeds {target_ms:g} ms already at concurrency {ttft[0][0]:g} "
                         "(measure lower concurrencies)")
        out["ttft_bound_concurrency"] = 1
        return out
    crossing = _interpolate(ttft, target_ms)
    if crossing is None:
        out["status"] = f"P95 TTFT stays under {target_ms:g} ms up to concurrency {ttft[-1][0]:g} (measured)"
        return out
    out.update(status="interpolated", crossing_concurrency=crossing, ttft_bound_concurrency=math.floor(crossing))
    queue = [(float(p["max_concurrency"]), (p.get("server") or {}).get("queue_depth_p95")) for p in points]
    depths = [q for _, q in queue if q is not None]
    if len(depths) == len(queue):
        # The queue depth the server showed at the crossing point: a measured trigger for scaling out.
        xs = [c for c, _ in queue]
        out["queue_depth_p95_at_crossing"] = _lerp(xs, [float(q) for q in depths], crossing)
    return out


def _lerp(xs: list[float], ys: list[float], x: float) -> float:
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
    return ys[-1]


def plan_cost(plan: dict[str, Any], price_per_device_hour: float, profile: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The plan's devices an hour and, with a measured profile (a `bench sweep` on this model and device), the cost
    of a million output tokens at the operating concurrency, from the output throughput interpolated there."""
    if not price_per_device_hour > 0:
        raise InvalidRequestError("--price-per-hour must be positive")
    devices = plan.get("devices_needed") or plan["tensor_parallel_size"]
    out: dict[str, Any] = {"price_per_device_hour": price_per_device_hour, "devices": devices,
                           "per_hour": devices * price_per_device_hour, "per_million_output_tokens": None,
                           "replica_output_tok_s": None}
    points = sorted((float(p["max_concurrency"]), float(p["output_throughput"]))
                    for p in (profile or {}).get("points", [])
                    if p.get("max_concurrency") and p.get("output_throughput"))
    if points:
        xs, ys = [c for c, _ in points], [t for _, t in points]
        concurrency = min(max(plan["concurrency_per_replica"], xs[0]), xs[-1])  # measured range only
        tok_s = _lerp(xs, ys, concurrency)
        out.update(replica_output_tok_s=tok_s, at_concurrency=concurrency,
                   per_million_output_tokens=price_per_device_hour * plan["tensor_parallel_size"]
                   / (tok_s * 3600) * 1e6)
    return out


def scale_out_trigger(plan: dict[str, Any]) -> dict[str, Any]:
    """When to add a replica: requests queueing past ~10% of a replica's operating concurrency, or the P95
    TTFT target breached, sustained over a window (queues build before TTFT degrades, so queue depth warns first).
    """
    per_replica = plan["concurrency_per_replica"]
    measured = (plan.get("profile") or {}).get("queue_depth_p95_at_crossing")
    depth = max(1, math.ceil(measured)) if measured is not None else max(1, math.ceil(0.1 * per_replica))
    text = f"P95 queue depth (num_requests_waiting) > {depth} per replica"
    if plan.get("target_ttft_ms") is not None:
        text += f" or P95 TTFT > {plan['target_ttft_ms']:g} ms"
    return {"p95_queue_depth": depth, "p95_ttft_ms": plan.get("target_ttft_ms"), "window": SCALE_OUT_WINDOW,
            "queue_depth_source": "profile" if measured is not None else "10% of per-replica concurrency",
            "text": f"{text}, sustained over {SCALE_OUT_WINDOW}"}


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n / 1024:,.2f} KiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def format_plan(plan: dict[str, Any]) -> str:
    model, device = plan["model"], plan["device"]
    bw = f", {device['bandwidth_gbps']:g} GB/s" if device.get("bandwidth_gbps") else ""
    scales = KV_INT8_SCALE_BYTES * -(-model["head_dim"] // KV_INT8_GROUP)
    row = f"({model['head_dim']} + {scales} scales)" if plan["kv_cache_dtype"] == "int8" else str(model["head_dim"])
    kv_formula = (f"{model['num_layers']} layers × {model['num_kv_heads']} KV heads × {row} dim "
                  f"× 2 × {KV_VALUE_BYTES[plan['kv_cache_dtype']]:g} B")
    rows = [
        ("model", f"{model['name']} ({_count(model['num_params'])} parameters)"),
        ("device", f"{device['name']} ({device['memory_gib']:g} GiB{bw})"),
        (f"weights ({plan['dtype']})", _gib(plan["weights_bytes"])),
        (f"KV cache per token ({plan['kv_cache_dtype']})",
         f"{plan['kv_bytes_per_token'] / 1024:,.1f} KiB = {kv_formula}"),
        (f"KV per sequence at {plan['max_model_len']} tokens", _gib(plan["kv_bytes_per_sequence"])),
        ("usable memory per device", f"{_gib(plan['usable_bytes_per_device'])} "
                                     f"(headroom {plan['headroom'] * 100:g}%)"),
        ("tensor parallel size", str(plan["tensor_parallel_size"])),
        ("KV cache per device", _gib(plan["kv_bytes_per_device"])),
        ("KV tokens per replica", f"{plan['kv_tokens_per_replica']:,}"),
        ("max concurrency per replica", f"{plan['max_concurrency_per_replica']} (at {plan['max_model_len']} tokens)"),
    ]
    if plan["decode_tok_s_ceiling_batch1"] is not None:
        rows.append(("batch-1 decode ceiling", f"~{plan['decode_tok_s_ceiling_batch1']:,.0f} tok/s per sequence "
                                               "(bandwidth-bound)"))
    profile = plan.get("profile")
    if profile:
        crossing = profile["crossing_concurrency"]
        shown = f"~{crossing:.1f} concurrent" if crossing is not None else profile["status"]
        rows.append((f"P95 TTFT crosses {plan['target_ttft_ms']:g} ms at", shown))
    rows.append(("operating concurrency per replica", str(plan["concurrency_per_replica"])))
    if plan.get("devices_needed") is not None:
        rows += [("target concurrency", str(plan["target_concurrency"])),
                 ("replicas needed", f"{plan['replicas_needed']} × TP {plan['tensor_parallel_size']} = "
                                     f"{plan['devices_needed']} devices")]
    cost = plan.get("cost")
    if cost:
        rows.append(("cost", f"{cost['per_hour']:,.2f} an hour ({cost['devices']} device(s) × "
                             f"{cost['price_per_device_hour']:g})"))
        if cost["per_million_output_tokens"] is not None:
            rows.append(("cost per 1M output tokens",
                         f"{cost['per_million_output_tokens']:,.3f} (a replica measured at "
                         f"{cost['replica_output_tok_s']:,.0f} tok/s, concurrency {cost['at_concurrency']:g})"))
    rows += [("scale-out trigger", plan["scale_out_trigger"]["text"]),
             ("server flags (vLLM names)", plan["serve_flags"])]
    width = max(len(label) for label, _ in rows) + 2
    return "\n".join(f"{label:<{width}}{value}" for label, value in rows)
