"""Load-to-ready and peak resident memory: seconds from launching a server to its /health answering 200,
the peak RSS (VmHWM) summed over the server's processes then, and tokenmill's own start-up memory line.

    python benchmarks/results/2026-12-08-load/ready.py MODEL.gguf KV_MIB ROUNDS OUT.json

Alternates the engines (tokenmill first in even rounds); tokenmill runs at its defaults and with
llama.cpp's KV budget (KV_MIB: llama.cpp's -c 16384 at 16-bit K and V; skipped where that is tokenmill's
default 2048 MiB), llama.cpp with -c 16384 -np 16. Given a safetensors directory, the peer is vLLM's CPU
backend as `make bench-peers` starts it, with tokenmill's default KV budget (2 GiB).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request


def ready(cmd, port, log_path):
    log = open(log_path, "wb")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                break
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited: see {log_path}")
            time.sleep(0.05)
    took = time.perf_counter() - start
    pids = [proc.pid] + [int(p) for p in subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True,
                                                        text=True).stdout.split() if int(p) != proc.pid]
    hwm = 0
    for pid in pids:
        try:
            hwm += int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("VmHWM")).split()[1]) // 1024
        except (OSError, StopIteration):
            pass
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()
    log.close()
    text = open(log_path, errors="replace").read()
    memory = re.search(r"memory: (.*)", text)
    return took, hwm, memory.group(1) if memory else None


model, kv_mib, rounds, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
safetensors = os.path.isdir(model)  # a safetensors directory: against vLLM's CPU backend instead
vllm_dtype = "bfloat16" if "avx512_bf16" in open("/proc/cpuinfo").read() else "float32"
peer = "vLLM" if safetensors else "llama.cpp"
engines = {
    "tokenmill": [".venv/bin/tokenmill", "serve", "--model", model, "--port", "8211", "--disable-log-stats"],
    "tokenmill-kv": [".venv/bin/tokenmill", "serve", "--model", model, "--port", "8211", "--disable-log-stats",
                     "--kv-cache-memory-bytes", str(kv_mib << 20)],
    "llama.cpp": [".bench/llama.cpp/build/bin/llama-server", "-m", model, "-np", "16", "-c", "16384", "-t", "2",
                  "--port", "8212"],
    # vLLM's CPU backend as make bench-peers starts it, with tokenmill's default KV budget (2 GiB).
    "vLLM": ["env", "VLLM_CPU_KVCACHE_SPACE=2", "VLLM_CPU_OMP_THREADS_BIND=0-1", ".bench/vllm-venv/bin/python", "-m",
             "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", vllm_dtype, "--max-model-len", "4096",
             "--max-num-seqs", "64", "--no-enable-prefix-caching", "--port", "8212"],
}
result = {"model": model, "cpu": next(l for l in open("/proc/cpuinfo") if l.startswith("model name")).split(":")[1].strip(),
          "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
          "rounds": []}
for r in range(rounds):
    order = ["tokenmill", "tokenmill-kv", peer] if r % 2 == 0 else [peer, "tokenmill-kv", "tokenmill"]
    for name in order:
        if name == "tokenmill-kv" and (kv_mib == 2048 or safetensors):  # tokenmill's default budget already
            continue
        took, hwm, memory = ready(engines[name], 8212 if name == peer else 8211, f"/tmp/ready-{name}.log")
        row = {"round": r, "engine": name, "command": engines[name], "load_to_ready_s": round(took, 3),
               "peak_rss_mib_at_ready": hwm, "memory_line": memory}
        result["rounds"].append(row)
        print(json.dumps(row), flush=True)
json.dump(result, open(out_path, "w"), indent=1)
