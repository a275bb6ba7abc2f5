"""Load-to-ready: seconds from launching a server to its /health answering 200, and the server's peak RSS then."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def ready(cmd, port):
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                break
        except Exception:
            time.sleep(0.05)
    took = time.perf_counter() - t
    hwm = 0
    for pid in [p.pid] + [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()]:
        try:
            hwm += int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("VmHWM")).split()[1]) // 1024
        except Exception:
            pass
    os.killpg(p.pid, signal.SIGTERM); p.wait()
    return took, hwm
gguf = sys.argv[1]
engines = {
    "tokenmill": [".venv/bin/tokenmill", "serve", "--model", gguf, "--port", "8211", "--disable-log-stats"],
    "llama.cpp": [".bench/llama.cpp/build/bin/llama-server", "-m", gguf, "-np", "16", "-c", "16384", "-t", "2", "--port", "8212"],
}
out = {"model": gguf, "rounds": []}
for r in range(2):
    for name in (("tokenmill", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "tokenmill")):
        took, hwm = ready(engines[name], 8211 if name == "tokenmill" else 8212)
        out["rounds"].append({"engine": name, "command": engines[name], "load_to_ready_s": took, "peak_rss_mib_at_ready": hwm})
        print(name, round(took, 2), hwm, flush=True)
print(json.dumps(out))
