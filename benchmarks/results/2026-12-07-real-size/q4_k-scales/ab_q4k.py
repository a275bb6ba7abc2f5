import json
import statistics
import sys

import torch

from benchmarks.decode_floor import one_stream_decode, weight_bytes_per_token
from tokenmill import LLM
from tokenmill.model.layers import linear

path = sys.argv[1]
new = linear._fits_float16
linear._fits_float16 = lambda v: bool(torch.equal(v.half().float(), v))
a = LLM(path, max_model_len=1024, kv_cache_memory_bytes="256MiB")
linear._fits_float16 = new
b = LLM(path, max_model_len=1024, kv_cache_memory_bytes="256MiB")
wa = weight_bytes_per_token(a.llm_engine.core.core.runner.model); wb = weight_bytes_per_token(b.llm_engine.core.core.runner.model)
res = {"float32 scales": [], "float16 scales": []}
for r in range(4):
    for name, llm in (("float32 scales", a), ("float16 scales", b)) if r % 2 == 0 else (("float16 scales", b), ("float32 scales", a)):
        res[name] += [t * 1e3 for t in one_stream_decode(llm, 64, 1)]
print(json.dumps({"weight_bytes": {"float32 scales": wa, "float16 scales": wb}, "ms_per_token": res,
                  "median": {k: statistics.median(v) for k, v in res.items()}}, indent=1))
