// Small hand-drawn line charts on <canvas>: no library. window.drawLineChart(canvas, times, series, opts).
(function () {
  "use strict";

  function niceMax(value) {
    // Round the y-axis top up to 1, 2 or 5 times a power of ten so the label reads cleanly.
    if (!(value > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 5, 10]) {
      if (value <= step * power) return step * power;
    }
    return 10 * power;
  }

  function formatTick(value) {
    if (value >= 1000) return (value / 1000).toFixed(value >= 10000 ? 0 : 1) + "k";
    if (value >= 10 || value === 0) return String(Math.round(value));
    return value.toFixed(1);
  }

  // times: seconds (epoch); series: [{values: [number|null], color}]; opts: {span (s), minMax, fixedMax, now}.
  function drawLineChart(canvas, times, series, opts) {
    opts = opts || {};
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 300;
    const height = canvas.clientHeight || 150;
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(height * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);

    const left = 36, right = 6, top = 8, bottom = 18;
    const plotW = width - left - right, plotH = height - top - bottom;
    const span = opts.span || 120;
    const end = opts.now || (times.length ? times[times.length - 1] : Date.now() / 1000);
    const start = end - span;

    let maxValue = opts.minMax || 0;
    for (const s of series) {
      s.values.forEach((v, i) => {
        if (v !== null && v !== undefined && times[i] >= start && v > maxValue) maxValue = v;
      });
    }
    const yMax = opts.fixedMax || niceMax(maxValue);

    // Grid and labels.
    ctx.strokeStyle = "#e5e7eb";
    ctx.fillStyle = "#6b7280";
    ctx.lineWidth = 1;
    ctx.font = "10px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const y = top + plotH - (plotH * i) / 4;
      ctx.beginPath();
      ctx.moveTo(left, Math.round(y) + 0.5);
      ctx.lineTo(left + plotW, Math.round(y) + 0.5);
      ctx.stroke();
      if (i % 2 === 0) ctx.fillText(formatTick((yMax * i) / 4), left - 4, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const stepS = span >= 120 ? 30 : 10;
    for (let ago = span; ago >= 0; ago -= stepS) {
      const x = left + plotW * (1 - ago / span);
      ctx.fillText(ago === 0 ? "now" : "-" + ago + "s", Math.min(Math.max(x, left + 10), left + plotW - 10),
                   top + plotH + 4);
    }

    // Lines: a gap (null, or more than 3 s between points) lifts the pen; a lone point becomes a dot.
    const toX = (t) => left + plotW * ((t - start) / span);
    const toY = (v) => top + plotH - plotH * Math.min(v / yMax, 1);
    for (const s of series) {
      const segments = [];
      let current = null, lastT = null;
      s.values.forEach((v, i) => {
        const t = times[i];
        const present = t >= start && v !== null && v !== undefined;
        if (!present || (lastT !== null && t - lastT > 3)) current = null;
        if (present) {
          if (current === null) { current = []; segments.push(current); }
          current.push([toX(t), toY(v)]);
        }
        lastT = t;
      });
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.lineWidth = 1.8;
      ctx.lineJoin = "round";
      for (const points of segments) {
        if (points.length === 1) {
          ctx.beginPath();
          ctx.arc(points[0][0], points[0][1], 2, 0, 2 * Math.PI);
          ctx.fill();
          continue;
        }
        ctx.beginPath();
        points.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
        ctx.stroke();
      }
    }
  }

  window.drawLineChart = drawLineChart;
})();
