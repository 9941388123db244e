"""Tables for bench/ingest.py: ingest, queries and memory, server CPU, ratios and targets.

Ratios are rlvitals ÷ peer for throughput and peer ÷ rlvitals for time and memory, so bigger is
better for rlvitals everywhere. The targets (issue: service benchmark) are checked against each
MLflow configuration; against trackio the question is only whether rlvitals beats it.
"""

from __future__ import annotations

import math


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def _fmt_ms(x: float) -> str:
    return f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def _fmt_ratio(x: float) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x:,.0f}×" if x >= 10 else f"{x:.1f}×"


def render(results: list[dict], work, metric_count: int, floor: dict | None = None) -> str:
    lines = []
    lines.append(
        f"Ingest ({metric_count} metrics/step; points/s = median of {work.rounds} interleaved rounds; ms per request)"
    )
    lines.append("")
    lines.append("| server | per step pts/s | p50 | p99 | batched ×100 pts/s | p50 | p99 | "
                 f"{work.trainers} trainers pts/s | p50 | p99 |")  # fmt: skip
    lines.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in results:
        cells = [r["label"]]
        for key in ("per_step", "batched", "trainers"):
            p = r[key]
            mark = "*" if p["capped"] else ""
            cells += [_fmt_rate(p["points_per_s_median"]) + mark, _fmt_ms(p["p50_ms"]), _fmt_ms(p["p99_ms"])]
        lines.append("| " + " | ".join(cells) + " |")
    for r in results:
        if "alert_latency" in r:
            a = r["alert_latency"]
            lines.append("")
            lines.append(f"Point to alert, {r['label']} (while the ingest phases ran; {a['samples']} NaN points, "
                         f"each timed from its POST to the API answer that shows its alert): p50 "
                         f"{_fmt_ms(a['p50_ms'])} ms, p99 {_fmt_ms(a['p99_ms'])} ms, max {_fmt_ms(a['max_ms'])} ms")  # fmt: skip
    if floor:
        c = floor["ceiling"]
        lines.append(f"| SQLite alone (the ceiling: same rows, executemany + commit per request, no server) | "
                     f"{_fmt_rate(c['per_step']['points_per_s'])} | {_fmt_ms(c['per_step']['seconds_per_request'] * 1e3)} | — | "
                     f"{_fmt_rate(c['batched']['points_per_s'])} | {_fmt_ms(c['batched']['seconds_per_request'] * 1e3)} | — | — | — | — |")  # fmt: skip
        lines.append("")
        lines.append("Where one rlvitals request's CPU time goes (ms, median, timed in the bench process with the "
                     "server's code on its own SQLite file; HTTP + hand-off = the server's CPU per request minus the rest)")  # fmt: skip
        lines.append("")
        lines.append("| request | parse + validate | health rules (after the answer) | SQLite insert + commit | "
                     "rest of the transaction | HTTP + hand-off | server CPU per request (rules included) |")  # fmt: skip
        lines.append("|---|--:|--:|--:|--:|--:|--:|")
        single = [
            r
            for r in results
            if r["kind"] == "rlvitals" and "(" not in r["label"] and "workers" not in r["label"]
        ]
        for key, label in (
            ("per_step", "1 step (12 points)"),
            ("batched", f"{work.batch} steps ({work.batch * metric_count:,} points)"),
        ):
            b = floor["breakdown"][key]
            cpu = single[0][key]["server_cpu_ms_per_request"] if single else math.nan
            rest = b["parse_validate"] + b["ingest_many"] + b["health_rules"]
            http = cpu - rest if math.isfinite(cpu) else math.nan
            lines.append(f"| {label} | {_fmt_ms(b['parse_validate'])} | {_fmt_ms(b['health_rules'])} | "
                         f"{_fmt_ms(b['sqlite_insert_commit'])} | {_fmt_ms(b['rest_of_ingest'])} | "
                         f"{_fmt_ms(max(http, 0.0)) if math.isfinite(http) else '—'} | {_fmt_ms(cpu) if math.isfinite(cpu) else '—'} |")  # fmt: skip
    lines.append("")
    steps = {r["history_steps"] for r in results}
    lines.append(
        f"Queries over {', '.join(map(str, sorted(steps)))} steps (median), memory, keep-alive probe"
    )
    lines.append("")
    lines.append("| server | 1 metric ms | 12 metrics ms | RSS peak MiB | PSS end MiB | processes | "
                 "keep-alive GET p50 ms | startup s |")  # fmt: skip
    lines.append("|---|--:|--:|--:|--:|--:|--:|--:|")
    for r in results:
        lines.append(
            f"| {r['label']} | {_fmt_ms(r['history_1']['seconds_median'] * 1e3)} | "
            f"{_fmt_ms(r['history_12']['seconds_median'] * 1e3)} | {r['rss_peak_mib']:,.0f} | "
            f"{r['pss_end_mib']:,.0f} | {r['processes']} | {_fmt_ms(r['keepalive_get_p50_ms'])} | {r['startup_s']} |"
        )
    for r in results:
        if "history_12_json_seconds_median" in r:
            lines.append(f"| {r['label']}, 12 metrics as JSON (`format=json`, parsed with `json`; read after "
                         f"the workload, RSS peak with these reads) | — | "
                         f"{_fmt_ms(r['history_12_json_seconds_median'] * 1e3)} | "
                         f"{r['rss_peak_with_json_reads_mib']:,.0f} | | | | |")  # fmt: skip
    lines.append("")
    lines.append("Server CPU (user+system over the process tree; unaffected by other load on the machine)")
    lines.append("")
    lines.append("| server | per step ms/req | batched ms/req | trainers ms/req | points per CPU-s (per step) | "
                 "1 metric ms/query | 12 metrics ms/query |")  # fmt: skip
    lines.append("|---|--:|--:|--:|--:|--:|--:|")
    for r in results:
        lines.append(
            f"| {r['label']} | {_fmt_ms(r['per_step']['server_cpu_ms_per_request'])} | "
            f"{_fmt_ms(r['batched']['server_cpu_ms_per_request'])} | "
            f"{_fmt_ms(r['trainers']['server_cpu_ms_per_request'])} | "
            f"{_fmt_rate(r['per_step']['points_per_server_cpu_s'])} | "
            f"{_fmt_ms(r['history_1']['server_cpu_s_per_query'] * 1e3)} | "
            f"{_fmt_ms(r['history_12']['server_cpu_s_per_query'] * 1e3)} |"
        )
    if any(r[k]["capped"] for r in results for k in ("per_step", "batched", "trainers")):
        lines.append("")
        lines.append(f"* stopped at the time cap ({work.max_seconds:.0f}s; batched {work.batched_max_seconds:.0f}s):"
                     " the rate is over the requests that ran.")  # fmt: skip
    ours = [r for r in results if r["kind"] == "rlvitals"]
    peers = [r for r in results if r["kind"] != "rlvitals"]
    if ours and peers:
        lines.append("")
        lines.append("Ratios (rlvitals ÷ peer for throughput; peer ÷ rlvitals for time and memory)")
        lines.append("")
        lines.append(
            "| rlvitals vs | per step | batched | trainers | 1-metric history | 12-metric history | RSS |"
        )
        lines.append("|---|--:|--:|--:|--:|--:|--:|")
        for o in ours:
            for p in peers:
                lines.append(
                    "| "
                    + " | ".join([f"{o['label']} vs {p['label']}", *map(_fmt_ratio, ratios(o, p))])
                    + " |"
                )
        lines.append("")
        lines.extend(target_lines(ours, peers))
    return "\n".join(lines)


def ratios(o: dict, p: dict) -> list[float]:
    def div(a: float, b: float) -> float:
        return a / b if b > 0 else math.inf

    return [
        div(o["per_step"]["points_per_s_median"], p["per_step"]["points_per_s_median"]),
        div(o["batched"]["points_per_s_median"], p["batched"]["points_per_s_median"]),
        div(o["trainers"]["points_per_s_median"], p["trainers"]["points_per_s_median"]),
        div(p["history_1"]["seconds_median"], o["history_1"]["seconds_median"]),
        div(p["history_12"]["seconds_median"], o["history_12"]["seconds_median"]),
        div(p["rss_peak_mib"], o["rss_peak_mib"]),
    ]


TARGETS = (("per step", 20), ("batched", 30), ("trainers", 20), ("1-metric history", 50),
           ("12-metric history", 50), ("RSS", 10))  # fmt: skip
# Against trackio, the strongest peer: per step 4×, batched 3×, history 30×, RSS no more than trackio's.
TRACKIO_TARGETS = (("per step", 4), ("batched", 3), ("trainers", None), ("1-metric history", 30),
                   ("12-metric history", 30), ("RSS", 1))  # fmt: skip


def target_lines(ours: list[dict], peers: list[dict]) -> list[str]:
    out = []
    for o in ours:
        for p in peers:
            got = ratios(o, p)
            if p["kind"] == "mlflow":
                checks = [f"{name} {_fmt_ratio(x)} {'ok' if x >= goal else f'MISS (<{goal}×)'}"
                          for (name, goal), x in zip(TARGETS, got, strict=True)]  # fmt: skip
            else:
                checks = [(f"{name} {_fmt_ratio(x)} {'ok' if x >= goal else f'MISS (<{goal}×)'}" if goal else
                           f"{name} {'beats' if x > 1 else 'LOSES'} ({_fmt_ratio(x)})")
                          for (name, goal), x in zip(TRACKIO_TARGETS, got, strict=True)]  # fmt: skip
            out.append(f"- {o['label']} vs {p['label']}: " + "; ".join(checks))
    return out
