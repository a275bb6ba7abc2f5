// tokenmill web page: a live dashboard polling /stats and a streaming chat playground.
(function () {
  "use strict";

  const POLL_MS = 2000;
  const CHART_SPAN_S = 120;
  const $ = (id) => document.getElementById(id);
  const color = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  // ---- formatting -------------------------------------------------------------------------
  function fmtSeconds(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms";
    return s.toFixed(2) + " s";
  }
  function fmtRate(v) {
    if (v === null || v === undefined) return "–";
    return v >= 100 ? v.toFixed(0) : v.toFixed(1);
  }
  function fmtPercent(v) {
    return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%";
  }
  function setPercentiles(el, summary) {
    el.replaceChildren(...["p50", "p95", "p99"].map((p) => {
      const cell = document.createElement("div");
      const label = document.createElement("small");
      const value = document.createElement("b");
      label.textContent = p;
      value.textContent = fmtSeconds(summary ? summary[p] : null);
      cell.append(label, value);
      return cell;
    }));
  }

  // ---- dashboard --------------------------------------------------------------------------
  let lastStats = null;
  let pickedModel = "";  // the model the dashboard shows and the playground talks to ("" = the default)

  // A server of several models: a picker of the loaded ones (stats.models lists every model it knows).
  function renderModelPicker(stats) {
    const picker = $("model-picker");
    const loaded = (stats.models || []).filter((m) => m.state === "loaded").map((m) => m.name);
    picker.hidden = loaded.length < 2;
    $("model-name").hidden = !picker.hidden;
    const current = Array.from(picker.options).map((o) => o.value);
    if (current.join("\n") !== loaded.join("\n")) {
      picker.replaceChildren(...loaded.map((name) => new Option(name, name)));
    }
    picker.value = stats.model;
  }
  $("model-picker").addEventListener("change", (event) => {
    pickedModel = event.target.value;
    poll(false);
  });

  function render(stats) {
    lastStats = stats;
    $("model-name").textContent = stats.model || "";
    // The device and why (a warning colour when an NVIDIA driver is loaded that torch cannot use).
    const device = stats.device;
    $("engine-device").textContent = device ? device.value : "";
    $("engine-device").title = device ? device.reason : "";
    $("engine-device").classList.toggle("warn", !!device && device.reason.includes("NVIDIA driver"));
    renderModelPicker(stats);
    $("window-hint").textContent = "percentiles over the last " + Math.round(stats.window_s) + " s";
    $("stat-output-tps").textContent = fmtRate(stats.output_tokens_per_s);
    $("stat-prompt-tps").textContent = fmtRate(stats.prompt_tokens_per_s);
    setPercentiles($("stat-ttft"), stats.ttft_s);
    setPercentiles($("stat-itl"), stats.itl_s);
    $("stat-ttft-count").textContent = stats.ttft_s ? stats.ttft_s.count : 0;
    $("stat-e2e-p50").textContent = fmtSeconds(stats.e2e_s ? stats.e2e_s.p50 : null);
    $("stat-running").textContent = stats.num_requests_running;
    $("stat-waiting").textContent = stats.num_requests_waiting;
    $("stat-finished").textContent = stats.num_finished_requests;
    const reasons = Object.entries(stats.finish_reasons || {}).map(([k, v]) => k + " " + v).join(", ");
    $("stat-reasons").textContent = reasons || "no requests yet";
    const rejected = Object.values(stats.num_rejected || {}).reduce((a, b) => a + b, 0);
    $("stat-rejected").textContent = rejected;
    $("stat-kv").textContent = fmtPercent(stats.kv_cache_usage);
    $("stat-kv-bar").style.width = Math.min(100, 100 * (stats.kv_cache_usage || 0)) + "%";
    $("stat-hit-rate").textContent = fmtPercent(stats.prefix_cache_hit_rate);
    $("stat-preemptions").textContent = stats.num_preemptions;
    const spec = stats.spec_decode || {};
    $("stat-spec-rate").textContent = fmtPercent(spec.acceptance_rate);
    $("stat-spec-detail").textContent = spec.num_drafts
      ? spec.num_accepted_tokens + " of " + spec.num_draft_tokens + " · by position " +
        (spec.accepted_per_position || []).map((n) => fmtPercent(n / spec.num_drafts)).join(" ")
      : "no drafts verified";
    const offload = stats.kv_offload;
    $("card-kv-offload").hidden = !offload;
    if (offload) {
      $("stat-offload-rate").textContent = fmtPercent(offload.hit_rate);
      const mib = (bytes) => (bytes / 1048576).toFixed(bytes < 10485760 ? 1 : 0) + " MiB";
      const problems = offload.corrupt + offload.write_errors + offload.read_errors;
      $("stat-offload-detail").textContent = mib(offload.stored_bytes) + " stored" +
        (offload.host_stored_bytes ? " (" + mib(offload.host_stored_bytes) + " in memory)" : "") + " · " +
        mib(offload.bytes_read) +
        " read in " + fmtSeconds(offload.restore_seconds) + (problems ? " · " + problems + " errors" : "");
    }
    $("updated").textContent = "updated " + new Date(stats.time * 1000).toLocaleTimeString();
    drawCharts(stats);
  }

  function drawCharts(stats) {
    const history = stats.history || [];
    const times = history.map((p) => p.time);
    const pick = (key, scale) => history.map((p) => (p[key] === null || p[key] === undefined ? null : p[key] * (scale || 1)));
    const opts = { span: CHART_SPAN_S, now: stats.time };
    window.drawLineChart($("chart-throughput"), times, [
      { values: pick("output_tokens_per_s"), color: color("--c1") },
      { values: pick("prompt_tokens_per_s"), color: color("--c2") },
    ], opts);
    window.drawLineChart($("chart-requests"), times, [
      { values: pick("num_running"), color: color("--c1") },
      { values: pick("num_waiting"), color: color("--c3") },
    ], Object.assign({ minMax: 1 }, opts));
    window.drawLineChart($("chart-kv"), times, [
      { values: pick("kv_cache_usage", 100), color: color("--c4") },
    ], Object.assign({ fixedMax: 100 }, opts));
    window.drawLineChart($("chart-latency"), times, [
      { values: pick("ttft_mean_s", 1000), color: color("--c2") },
      { values: pick("itl_mean_s", 1000), color: color("--c1") },
    ], opts);
  }

  function setHealth(ok, text) {
    $("health-dot").className = "dot " + (ok ? "ok" : "bad");
    $("health-text").textContent = text;
  }

  async function poll(again = true) {
    try {
      const query = pickedModel ? "?model=" + encodeURIComponent(pickedModel) : "";
      const response = await fetch("/stats" + query, { cache: "no-store" });
      if (response.status === 404 && pickedModel) {
        pickedModel = "";  // the picked model was unloaded: back to the default one
        throw new Error("model unloaded");
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      render(await response.json());
      setHealth(true, "serving");
    } catch (err) {
      setHealth(false, "unreachable (" + err.message + ")");
    } finally {
      if (again) setTimeout(poll, POLL_MS);
    }
  }

  window.addEventListener("resize", () => lastStats && drawCharts(lastStats));

  // ---- playground -------------------------------------------------------------------------
  const conversation = [];  // {role, content} of completed turns
  let controller = null;

  const keyInput = $("api-key");
  keyInput.value = localStorage.getItem("tokenmill.apiKey") || "";
  keyInput.addEventListener("change", () => localStorage.setItem("tokenmill.apiKey", keyInput.value));

  function addMessage(role, text) {
    const hint = $("empty-hint");
    if (hint) hint.remove();
    const el = document.createElement("div");
    el.className = "msg " + role;
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    el.appendChild(body);
    $("messages").appendChild(el);
    scrollDown();
    return el;
  }
  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }
  function setMeta(el, text) {
    let meta = el.querySelector(".meta");
    if (!meta) {
      meta = document.createElement("span");
      meta.className = "meta";
      el.appendChild(meta);
    }
    meta.textContent = text;
  }
  function setBusy(busy) {
    $("send-btn").disabled = busy;
    $("stop-btn").disabled = !busy;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
      return JSON.stringify(body);
    } catch (_) {
      return response.statusText;
    }
  }

  // Reads an SSE body and calls onEvent(data string) per "data:" event until [DONE].
  async function readSse(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        onEvent(data);
      }
    }
  }

  async function send(text) {
    const messages = [];
    const system = $("system-prompt").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...conversation, { role: "user", content: text });
    addMessage("user", text);
    const reply = addMessage("assistant", "");
    reply.classList.add("streaming");
    const replyText = reply.querySelector(".text");

    const headers = { "Content-Type": "application/json" };
    if (keyInput.value) headers["Authorization"] = "Bearer " + keyInput.value;
    const temperature = parseFloat($("temperature").value);
    const maxTokens = parseInt($("max-tokens").value, 10);
    const body = {
      messages, stream: true, stream_options: { include_usage: true },
      temperature: Number.isFinite(temperature) ? temperature : 0.7,
      max_tokens: Number.isFinite(maxTokens) && maxTokens > 0 ? maxTokens : 256,
    };
    if (lastStats && lastStats.model) body.model = lastStats.model;

    controller = new AbortController();
    setBusy(true);
    const start = performance.now();
    let firstToken = null, chunks = 0, usage = null, finish = null, content = "", failed = false;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers, body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) {
        throw new Error(response.status + ": " + await errorText(response) +
                        (response.status === 401 ? " (set the API key above)" : ""));
      }
      await readSse(response, (data) => {
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
        if (event.usage) usage = event.usage;
        for (const choice of event.choices || []) {
          const delta = (choice.delta && choice.delta.content) || "";
          if (delta) {
            if (firstToken === null) firstToken = performance.now();
            chunks += 1;
            content += delta;
            replyText.textContent = content;
            scrollDown();
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      });
      conversation.push({ role: "user", content: text }, { role: "assistant", content });
    } catch (err) {
      if (err.name === "AbortError") {
        finish = "stopped";
      } else {
        failed = true;
        reply.classList.add("error");
        replyText.textContent = (content ? content + "\n" : "") + "Error: " + err.message;
      }
    } finally {
      const end = performance.now();
      reply.classList.remove("streaming");
      const tokens = usage ? usage.completion_tokens : chunks;
      // Tokens per second of the reply's decoding: tokens after the first over the time after it.
      const decodeS = firstToken !== null ? (end - firstToken) / 1000 : 0;
      const tps = tokens > 1 && decodeS > 0 ? (tokens - 1) / decodeS : null;
      const parts = [];
      if (firstToken !== null) parts.push("TTFT " + fmtSeconds((firstToken - start) / 1000));
      if (tps !== null) parts.push(fmtRate(tps) + " tok/s");
      if (!failed || tokens) parts.push(tokens + " tokens");
      if (finish) parts.push("finish: " + finish);
      parts.push((failed ? "failed after " : "total ") + fmtSeconds((end - start) / 1000));
      setMeta(reply, parts.join(" · "));
      reply.dataset.ttftMs = firstToken !== null ? String(firstToken - start) : "";
      reply.dataset.tokens = String(tokens);
      reply.dataset.done = "true";
      controller = null;
      setBusy(false);
    }
  }

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = $("chat-input");
    const text = input.value.trim();
    if (!text || controller) return;
    input.value = "";
    send(text);
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-btn").addEventListener("click", () => controller && controller.abort());
  $("clear-btn").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
  });

  poll();
})();
