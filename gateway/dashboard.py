"""`GET /dashboard`: one self-refreshing page of the fleet (no build step), fed by
`GET /dashboard/data`."""

from __future__ import annotations

import time
from typing import Any

from pagefleet.gateway.registry import ReplicaRegistry

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pagefleet</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 2em; color: #222; }
  h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 1.5em; }
  table { border-collapse: collapse; min-width: 640px; }
  td, th { padding: 4px 10px; text-align: left; border-bottom: 1px solid #ddd; }
  .bar { width: 220px; height: 12px; background: #eee; border-radius: 3px; overflow: hidden; }
  .bar div { height: 100%; background: #3a7bd5; }
  .muted { color: #888; }
</style>
</head>
<body>
<h1>pagefleet <span class="muted" id="status">loading…</span></h1>
<div id="models"></div>
<script>
const previous = {};
function row(replica) {
  const used = Math.round(100 * (1 - replica.free_blocks / replica.total_blocks));
  return `<tr class="replica" data-replica="${replica.replica_id}"><td>${replica.replica_id}</td>
    <td><div class="bar"><div style="width:${used}%"></div></div></td><td>${used}%
    (${replica.total_blocks - replica.free_blocks}/${replica.total_blocks} blocks)</td>
    <td>${replica.running}</td><td>${replica.waiting}</td>
    <td class="restarts">${replica.restarts || 0}</td><td class="muted">${replica.url}</td></tr>`;
}
async function refresh() {
  try {
    const data = await (await fetch("dashboard/data")).json();
    const now = data.time;
    let html = "";
    for (const model of data.models) {
      const before = previous[model.name];
      const rate = before ? ((model.requests - before.requests) / (now - before.time)).toFixed(2) : "–";
      previous[model.name] = {requests: model.requests, time: now};
      html += `<h2 class="model">${model.name} <span class="muted">${model.replicas.length} replicas,
        ${rate} requests/s</span></h2><table><tr><th>replica</th><th>KV cache</th><th></th>
        <th>running</th><th>waiting</th><th>restarts</th><th>url</th></tr>${model.replicas.map(row).join("")}</table>`;
    }
    document.getElementById("models").innerHTML = html || "<p>No live replicas.</p>";
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


def dashboard_data(registry: ReplicaRegistry, requests_by_model: dict[str, float]) -> dict[str, Any]:
    models = []
    for name in registry.models():
        replicas = sorted(registry.candidates(name), key=lambda r: r.replica_id)
        models.append(
            {
                "name": name,
                "requests": requests_by_model.get(name, 0.0),
                "replicas": [r.model_dump() for r in replicas],
            }
        )
    return {"time": time.time(), "registry_available": registry.is_available, "models": models}
