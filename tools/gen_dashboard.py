"""Write deploy/grafana/dashboards/minivllm.json: the Grafana dashboard of SPEC §6.

Panels are declared here once (title, unit, PromQL queries) and laid out on a 24-column grid; run
`python tools/gen_dashboard.py` after changing them (a test checks every query against a live scrape).
Queries sum over the `replica` label, so one dashboard serves a plain server and a replicated front.
"""

from __future__ import annotations

import json
import os

RANGE = "[$__rate_interval]"


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate({metric}_bucket{RANGE})))") for q in (50, 95, 99)]


# (title, unit, [(legend, expr)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Output throughput", "tok/s", [("generated", f"sum(rate(minivllm:generation_tokens_total{RANGE}))"),
                                    ("prompt", f"sum(rate(minivllm:prompt_tokens_total{RANGE}))")]),
    ("Requests by outcome", "reqps", [("{{endpoint}} {{status}}",
                                       f"sum by (endpoint, status) (rate(inference_requests_total{RANGE})) > 0")]),
    ("Time to first token", "s", _quantiles("minivllm:time_to_first_token_seconds")),
    ("Inter-token latency", "s", _quantiles("minivllm:inter_token_latency_seconds")),
    ("End-to-end latency", "s", _quantiles("minivllm:e2e_request_latency_seconds")),
    ("Queue time", "s", _quantiles("minivllm:request_queue_time_seconds")),
    ("Running and waiting requests", "short", [("running", "sum(minivllm:num_requests_running)"),
                                               ("waiting", "sum(minivllm:num_requests_waiting)")]),
    ("KV cache usage", "percentunit", [("{{replica}}", "max by (replica) (minivllm:kv_cache_usage_perc)")]),
    ("Preemptions", "short", [("per second", f"sum(rate(minivllm:num_preemptions_total{RANGE}))"),
                              ("{{mode}}", f"sum by (mode) (rate(minivllm:num_preemptions_by_mode_total{RANGE}))")]),
    ("KV swap (host tier)", "Bps", [("out", f"sum(rate(minivllm:kv_swap_out_bytes_total{RANGE}))"),
                                    ("in", f"sum(rate(minivllm:kv_swap_in_bytes_total{RANGE}))")]),
    ("Host tier usage", "percentunit", [("{{replica}}", "max by (replica) (minivllm:cpu_cache_usage_perc)")]),
    ("Swapped requests and blocks", "short", [("requests", "sum(minivllm:num_requests_swapped)"),
                                              ("blocks", "sum(minivllm:num_swapped_blocks)")]),
    ("KV blocks evicted (sink-window)", "short",
     [("per second", f"sum(rate(minivllm:kv_evicted_blocks_total{RANGE}))")]),
    ("Prefix cache hit rate", "percentunit", [("hit rate", f"sum(rate(minivllm:prefix_cache_hits_total{RANGE})) / "
                                               f"sum(rate(minivllm:prefix_cache_queries_total{RANGE}))")]),
    ("Errors by cause", "reqps", [("{{endpoint}} {{status}}", "sum by (endpoint, status) (rate(inference_requests_"
                                  f"total{{status=~\"client_error|server_error|aborted\"}}{RANGE}))"),
                                 ("engine aborts", "sum(rate(minivllm:request_success_total"
                                  f"{{finished_reason=\"abort\"}}{RANGE}))")]),
    ("Finished requests by reason", "reqps", [("{{finished_reason}}", "sum by (finished_reason) "
                                               f"(rate(minivllm:request_success_total{RANGE}))")]),
    ("Tokens per engine step", "short", _quantiles("minivllm:iteration_tokens_total")),
    # SLO classes (interactive, batch, background): is each class served within its TTFT deadline?
    ("Time to first token p95 by class", "s", [("{{class}}", "histogram_quantile(0.95, sum by (le, class) "
                                                f"(rate(minivllm:time_to_first_token_by_class_seconds_bucket{RANGE})))")]),
    ("TTFT deadline misses by class", "reqps", [("{{class}}", "sum by (class) "
                                                 f"(rate(minivllm:request_deadline_miss_total{RANGE}))")]),
    ("Queue time p95 by class", "s", [("{{class}}", "histogram_quantile(0.95, sum by (le, class) "
                                       f"(rate(minivllm:request_queue_time_by_class_seconds_bucket{RANGE})))")]),
    ("Event-loop lag", "s", [("p99", "histogram_quantile(0.99, sum by (le) "
                              f"(rate(minivllm:event_loop_lag_seconds_bucket{RANGE})))"),
                             ("max seen", "max(minivllm:event_loop_lag_max_seconds)")]),
    ("Server process", "percentunit", [("CPU (cores)", f"rate(process_cpu_seconds_total{RANGE})")]),
    ("Server memory", "bytes", [("RSS", "process_resident_memory_bytes")]),
]

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}


def dashboard() -> dict:
    """The dashboard as Grafana's JSON model."""
    panels = []
    for i, (title, unit, queries) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                        for j, (legend, expr) in enumerate(queries)],
        })
    return {"uid": "minivllm", "title": "Mini-vLLM", "tags": ["minivllm", "llm"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "refresh": "5s", "time": {"from": "now-15m", "to": "now"},
            "editable": False, "panels": panels, "templating": {"list": []}, "annotations": {"list": []}}


def main() -> None:
    path = os.path.join(os.path.dirname(__file__), "..", "deploy", "grafana", "dashboards", "minivllm.json")
    with open(path, "w") as f:
        json.dump(dashboard(), f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
