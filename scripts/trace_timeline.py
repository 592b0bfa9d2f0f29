#!/usr/bin/env python3
"""Per-rank traces of `tessera train --trace` as one picture or one file.

`--trace FILE` writes one Chrome-trace file per rank (trace.rank<r>.json).
This tool, using only the standard library:

  trace_timeline.py merge trace.json trace.rank*.json
      one trace file with every rank (a process per rank) for Perfetto
      (https://ui.perfetto.dev) or chrome://tracing
  trace_timeline.py svg timeline.svg trace.rank*.json [--from-ms A --to-ms B]
      a timeline: one row per rank, forward (F<m>) and backward (B<m>)
      boxes of each micro-batch, exchanges, gradient synchronisation; so a
      pipeline schedule (GPipe, 1F1B) reads at a glance
  trace_timeline.py text trace.rank*.json [--from-ms A --to-ms B]
      the same as lines: per rank, the sequence of F<m>/B<m> in time order
"""
import argparse
import json
import sys

COLOURS = {"forward": "#4c78a8", "backward": "#f58518", "p2p": "#bab0ac", "grad_sync": "#54a24b",
           "embedding_grad_sync": "#54a24b", "optimizer": "#b279a2", "data_wait": "#eeeeee"}


def load(paths):
    ranks = []
    for path in paths:
        with open(path) as handle:
            trace = json.load(handle)
        rank = trace.get("otherData", {}).get("rank", len(ranks))
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        ranks.append((rank, events, trace))
    ranks.sort(key=lambda item: item[0])
    return ranks


def window(ranks, start_ms, end_ms):
    t0 = min(e["ts"] for _, events, _ in ranks for e in events)
    lo = t0 + (start_ms or 0) * 1000
    hi = t0 + end_ms * 1000 if end_ms is not None else float("inf")
    return t0, lo, hi


def kind(name):
    return name.split(" ")[0]


def label(name):
    parts = name.split(" ")
    if parts[0] in ("forward", "backward") and len(parts) > 1:
        return ("F" if parts[0] == "forward" else "B") + parts[1]
    return ""


def merge(out, paths):
    events = []
    for _, rank_events, trace in load(paths):
        events += [e for e in trace["traceEvents"]]
    with open(out, "w") as handle:
        json.dump({"displayTimeUnit": "ms", "traceEvents": events}, handle)


def svg(out, paths, start_ms, end_ms):
    ranks = load(paths)
    t0, lo, hi = window(ranks, start_ms, end_ms)
    shown = [(r, [e for e in events if e["ts"] >= lo and e["ts"] + e["dur"] <= hi and kind(e["name"]) in COLOURS])
             for r, events, _ in ranks]
    begin = min(e["ts"] for _, events in shown for e in events)
    end = max(e["ts"] + e["dur"] for _, events in shown for e in events)
    width, row, left = 1200.0, 36, 70
    scale = (width - left - 10) / (end - begin)
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{row * len(shown) + 50}" '
             'font-family="sans-serif" font-size="11">',
             '<rect width="100%" height="100%" fill="white"/>']
    for i, (rank, events) in enumerate(shown):
        y = 10 + i * row
        lines.append(f'<text x="5" y="{y + 20}">rank {rank}</text>')
        for e in events:
            x = left + (e["ts"] - begin) * scale
            w = max(e["dur"] * scale, 0.5)
            lines.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 8}" '
                         f'fill="{COLOURS[kind(e["name"])]}" stroke="white" stroke-width="0.5"/>')
            text = label(e["name"])
            if text and w > 14:
                lines.append(f'<text x="{x + w / 2:.1f}" y="{y + 18}" text-anchor="middle" fill="white">{text}</text>')
    y = 10 + len(shown) * row + 12
    x = left
    for name in ("forward", "backward", "p2p", "grad_sync", "optimizer"):
        lines.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{COLOURS[name]}"/>'
                     f'<text x="{x + 16}" y="{y + 10}">{name}</text>')
        x += 110
    lines.append(f'<text x="{x}" y="{y + 10}">{(end - begin) / 1000:.1f} ms from {(begin - t0) / 1000:.1f} ms</text>')
    lines.append("</svg>")
    with open(out, "w") as handle:
        handle.write("\n".join(lines) + "\n")


def text(paths, start_ms, end_ms):
    ranks = load(paths)
    _, lo, hi = window(ranks, start_ms, end_ms)
    for rank, events, _ in ranks:
        order = [label(e["name"]) for e in sorted(events, key=lambda e: e["ts"])
                 if lo <= e["ts"] <= hi and label(e["name"])]
        print(f"rank {rank}: " + " ".join(order))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["merge", "svg", "text"])
    parser.add_argument("paths", nargs="+", help="output file (merge, svg) then the per-rank trace files")
    parser.add_argument("--from-ms", type=float, default=None, help="start of the window, from the first event")
    parser.add_argument("--to-ms", type=float, default=None, help="end of the window, from the first event")
    args = parser.parse_args()
    if args.command == "text":
        text(args.paths, args.from_ms, args.to_ms)
    elif len(args.paths) < 2:
        sys.exit(f"{args.command}: give the output file, then the trace files")
    elif args.command == "merge":
        merge(args.paths[0], args.paths[1:])
    else:
        svg(args.paths[0], args.paths[1:], args.from_ms, args.to_ms)


if __name__ == "__main__":
    main()
