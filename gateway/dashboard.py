"""`GET /dashboard`: one self-refreshing page of the fleet (no build step, nothing fetched
from elsewhere; its charts are SVG drawn by the page itself), fed by `GET /dashboard/data`:
the replicas now, and the charts of the gateway's `FleetHistory`."""

from __future__ import annotations

import time
from typing import Any

from pagefleet.gateway.history import FleetHistory
from pagefleet.gateway.registry import ReplicaRegistry

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pagefleet</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 1.5em 2em; color: #222; background: #fafafa; }
  h1 { font-size: 20px; margin: 0 0 .5em; } h2 { font-size: 16px; margin: 1.5em 0 .5em; }
  table { border-collapse: collapse; min-width: 640px; background: #fff; }
  td, th { padding: 4px 10px; text-align: left; border-bottom: 1px solid #ddd; }
  .bar { width: 220px; height: 12px; background: #eee; border-radius: 3px; overflow: hidden; }
  .bar div { height: 100%; background: #3a7bd5; }
  .muted { color: #888; font-weight: normal; }
  .charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(330px, 1fr)); gap: 10px; margin-top: 10px; }
  figure { margin: 0; background: #fff; border: 1px solid #e3e3e3; border-radius: 4px; padding: 6px 8px; }
  figcaption { font-size: 13px; font-weight: 600; } figcaption span { font-weight: normal; color: #888; }
  svg.chart { width: 100%; height: 130px; } svg text { font-size: 10px; fill: #888; }
  .legend { font-size: 11px; color: #555; }
  .legend i { display: inline-block; width: 10px; height: 3px; margin: 0 4px 2px 8px; }
</style>
</head>
<body>
<h1>pagefleet <span class="muted" id="status">loading…</span></h1>
<div class="muted" id="window"></div>
<div id="models"></div>
<script>
const COLOURS = ["#3a7bd5", "#e4572e", "#29a36a", "#9b59b6", "#f0a202", "#17a2b8", "#c0392b", "#7f8c8d"];
const W = 320, H = 130, LEFT = 38, BOTTOM = 16;
function nice(max) {
  if (!(max > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(max)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= max) return m * step;
  return 10 * step;
}
function fmt(value) {
  if (value === 0) return "0";
  if (Math.abs(value) >= 1000) return (value / 1000).toFixed(1) + "k";
  return Math.abs(value) >= 10 ? value.toFixed(0) : Math.abs(value) >= 0.1 ? value.toFixed(2) : value.toPrecision(2);
}
function chart(spec, start, end) {
  const values = spec.series.flatMap(s => s.points.map(p => p[1]).filter(v => v !== null));
  const top = spec.unit === "%" ? 100 : nice(Math.max(0, ...values));
  const x = t => LEFT + (W - LEFT - 4) * (t - start) / (end - start);
  const y = v => (H - BOTTOM) - (H - BOTTOM - 6) * v / top;
  let svg = "";
  for (const f of [0, 0.5, 1]) {
    svg += `<line x1="${LEFT}" x2="${W - 4}" y1="${y(top * f)}" y2="${y(top * f)}" stroke="#eee"/>` +
      `<text x="${LEFT - 4}" y="${y(top * f) + 3}" text-anchor="end">${fmt(top * f)}</text>`;
  }
  svg += `<text x="${LEFT}" y="${H - 3}">-${Math.round(end - start)} s</text>` +
    `<text x="${W - 4}" y="${H - 3}" text-anchor="end">now</text>`;
  let legend = "", points = 0;
  spec.series.forEach((series, i) => {
    const colour = COLOURS[i % COLOURS.length];
    let d = "", pen = "M";
    for (const [t, v] of series.points) {
      if (v === null) { pen = "M"; continue; }
      d += `${pen}${x(t).toFixed(1)},${y(v).toFixed(1)}`; pen = "L"; points++;
    }
    svg += `<path class="series" d="${d}" fill="none" stroke="${colour}" stroke-width="1.5"/>`;
    const last = series.points.length ? series.points[series.points.length - 1][1] : null;
    legend += `<i style="background:${colour}"></i>${series.name}${last === null ? "" : " " + fmt(last)}`;
  });
  return `<figure><figcaption>${spec.title} <span>${spec.unit}</span></figcaption>
    <svg class="chart" data-chart="${spec.id}" data-points="${points}" viewBox="0 0 ${W} ${H}"
      preserveAspectRatio="none">${svg}</svg>
    <div class="legend">${legend || "none yet"}</div></figure>`;
}
function row(replica) {
  const used = Math.round(100 * (1 - replica.free_blocks / replica.total_blocks));
  return `<tr class="replica" data-replica="${replica.replica_id}"><td>${replica.replica_id}</td>
    <td><div class="bar"><div style="width:${used}%"></div></div></td><td>${used}%
    (${replica.total_blocks - replica.free_blocks}/${replica.total_blocks} blocks)</td>
    <td>${replica.running}</td><td>${replica.waiting}</td>
    <td class="restarts">${replica.restarts || 0}</td><td class="muted">${replica.url}</td></tr>`;
}
function requestRate(model) {
  const series = model.charts.find(c => c.id === "requests").series[0];
  const last = series && series.points[series.points.length - 1];
  return last ? last[1].toFixed(2) : "–";
}
async function refresh() {
  try {
    const data = await (await fetch("dashboard/data")).json();
    const start = Math.min(data.history.since, data.time - 10);  // the kept history, at least 10 s of axis
    let html = "";
    for (const model of data.models) {
      const replicas = model.replicas.length === 1 ? "1 replica" : `${model.replicas.length} replicas`;
      html += `<h2 class="model">${model.name} <span class="muted">${replicas},
        ${requestRate(model)} requests/s over the last ${data.history.window_s} s</span></h2>
        <table><tr><th>replica</th><th>KV cache</th><th></th>
        <th>running</th><th>waiting</th><th>restarts</th><th>url</th></tr>${model.replicas.map(row).join("")}</table>
        <div class="charts">${model.charts.map(c => chart(c, start, data.time)).join("")}</div>`;
    }
    document.getElementById("models").innerHTML = html || "<p>No live replicas.</p>";
    document.getElementById("window").textContent = `last ${data.history.span_s} s, sampled every
      ${data.history.interval_s} s; rates and percentiles over ${data.history.window_s} s windows`;
    document.getElementById("status").textContent = data.registry_available ? "live" : "Redis unreachable";
  } catch (error) {
    document.getElementById("status").textContent = "gateway unreachable";
  }
}
refresh();
setInterval(refresh, 1000);
</script>
</body>
</html>
"""


def dashboard_data(registry: ReplicaRegistry, history: FleetHistory) -> dict[str, Any]:
    models = [
        {
            "name": name,
            "replicas": [r.model_dump() for r in sorted(registry.candidates(name), key=lambda r: r.replica_id)],
            "charts": history.charts(name),
        }
        for name in registry.models()
    ]
    return {
        "time": time.time(),
        "registry_available": registry.is_available,
        "history": {
            "span_s": history.span,
            "interval_s": history.interval,
            "window_s": history.window,
            "since": history.snapshots[0].time if history.snapshots else time.time(),
        },
        "models": models,
    }
