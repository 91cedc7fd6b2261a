"""Write the Helm chart's Grafana dashboard (charts/pagefleet/dashboards/pagefleet-fleet.json):
the figures of the gateway's own /dashboard, from Prometheus, per model and replica.

Edit the panels here and run `python scripts/grafana_dashboard.py`; a test checks that the
JSON file is this script's output and that every metric its PromQL names is exported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parents[1] / "charts" / "pagefleet" / "dashboards" / "pagefleet-fleet.json"
ENGINE = 'model_name=~"$model"'
GATEWAY = 'model=~"$model"'
RATE = "[$__rate_interval]"


def quantiles(metric: str) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le, model_name) (rate({metric}_bucket{{{ENGINE}}}{RATE})))",
            f"{{{{model_name}}}} p{round(q * 100)}",
        )
        for q in (0.5, 0.99)
    ]


# (title, unit, [(PromQL, legend)]), three to a row.
SECTIONS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Engines, per replica",
        [
            ("KV cache usage", "percentunit", [(f"pagefleet:kv_cache_usage_perc{{{ENGINE}}}", "{{pod}}")]),
            ("Free KV blocks", "none", [(f"pagefleet:num_free_blocks{{{ENGINE}}}", "{{pod}}")]),
            (
                "Output tokens/s",
                "short",
                [(f"sum by (pod) (rate(pagefleet:generation_tokens_total{{{ENGINE}}}{RATE}))", "{{pod}}")],
            ),
            (
                "Running and waiting requests",
                "none",
                [
                    (f"pagefleet:num_requests_running{{{ENGINE}}}", "{{pod}} running"),
                    (f"pagefleet:num_requests_waiting{{{ENGINE}}}", "{{pod}} waiting"),
                ],
            ),
            (
                "Preemptions/s",
                "short",
                [(f"sum by (pod, mode) (rate(pagefleet:num_preemptions_total{{{ENGINE}}}{RATE}))", "{{pod}} {{mode}}")],
            ),
            (
                "Prefix cache hit rate",
                "percentunit",
                [
                    (
                        f"sum by (model_name) (rate(pagefleet:prefix_cache_hits_total{{{ENGINE}}}{RATE}))"
                        f" / sum by (model_name) (rate(pagefleet:prefix_cache_queries_total{{{ENGINE}}}{RATE}))",
                        "{{model_name}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Latency, per model",
        [
            ("Time to first token", "s", quantiles("pagefleet:time_to_first_token_seconds")),
            ("Inter-token latency", "s", quantiles("pagefleet:inter_token_latency_seconds")),
            ("End-to-end request latency", "s", quantiles("pagefleet:e2e_request_latency_seconds")),
        ],
    ),
    (
        "Gateway, per model",
        [
            (
                "Requests/s",
                "reqps",
                [(f"sum by (model) (rate(pagefleet_gateway:requests_total{{{GATEWAY}}}{RATE}))", "{{model}}")],
            ),
            (
                "Errors/s by status",
                "reqps",
                [
                    (
                        "sum by (model, status) "
                        f'(rate(pagefleet_gateway:requests_total{{{GATEWAY},status=~"[45].."}}{RATE}))',
                        "{{model}} {{status}} (replica)",
                    ),
                    (
                        f"sum by (model, status) (rate(pagefleet_gateway:errors_total{{{GATEWAY}}}{RATE}))",
                        "{{model}} {{status}} (gateway)",
                    ),
                ],
            ),
            (
                "Failovers/s",
                "reqps",
                [(f"sum by (replica) (rate(pagefleet_gateway:failovers_total{{{GATEWAY}}}{RATE}))", "{{replica}}")],
            ),
            (
                "Routing decisions/s by replica",
                "reqps",
                [
                    (
                        f"sum by (replica) (rate(pagefleet_gateway:routing_decisions_total{{{GATEWAY}}}{RATE}))",
                        "{{replica}}",
                    )
                ],
            ),
            (
                "Replica first byte p99",
                "s",
                [
                    (
                        "histogram_quantile(0.99, sum by (le, model) "
                        f"(rate(pagefleet_gateway:upstream_first_byte_seconds_bucket{{{GATEWAY}}}{RATE})))",
                        "{{model}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Operator and autoscaling",
        [
            (
                "Desired replicas",
                "none",
                [("pagefleet_operator:desired_replicas", "{{namespace}}/{{name}} {{pool}}")],
            ),
            (
                "KV utilization the autoscaler sees",
                "percentunit",
                [("pagefleet_operator:kv_utilization", "{{namespace}}/{{name}} {{pool}}")],
            ),
            (
                "Scaling events",
                "short",
                [
                    (
                        f"sum by (name, reason) (increase(pagefleet_operator:scaling_events_total{RATE}))",
                        "{{name}} {{reason}}",
                    )
                ],
            ),
        ],
    ),
]


def panel(panel_id: int, title: str, unit: str, queries: list[tuple[str, str]], x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for section, charts in SECTIONS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": section, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        y += 1
        for index, (title, unit, queries) in enumerate(charts):
            panels.append(panel(len(panels) + 1, title, unit, queries, 8 * (index % 3), y + 8 * (index // 3)))
        y += 8 * ((len(charts) + 2) // 3)
    variables = [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"},
        {
            "name": "model",
            "label": "Model",
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": "label_values(pagefleet:num_requests_running, model_name)", "refId": "models"},
            "definition": "label_values(pagefleet:num_requests_running, model_name)",
            "refresh": 2,
            "multi": True,
            "includeAll": True,
            "current": {"text": "All", "value": "$__all"},
        },
    ]
    return {
        "uid": "pagefleet-fleet",
        "title": "pagefleet fleet",
        "description": "KV cache, throughput, queues and latency of pagefleet's engines, gateway and operator",
        "tags": ["pagefleet", "llm", "inference"],
        "editable": True,
        "schemaVersion": 39,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
