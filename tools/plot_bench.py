#!/usr/bin/env python3
"""Charts `atomc bench serve` results like the InferenceMAX plots: output throughput per GPU
against interactivity (tokens/s per user = 1000 / median TPOT) and against end-to-end latency,
one line per engine across concurrency levels. Several result files (or folders of them) can be
overlaid, e.g. atomc against vLLM. Works on any vLLM-format result JSON.

usage: tools/plot_bench.py RESULT.json|DIR ... -o chart.png [--title T] [--label-key backend]
"""
import argparse
import collections
import glob
import json
import os
import sys


def load(paths):
    rows = []
    for p in paths:
        files = sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p]
        for f in files:
            with open(f) as fh:
                r = json.load(fh)
            if "output_throughput" not in r:
                continue
            r["_file"] = f
            rows.append(r)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("-o", "--output", required=True, help="PNG or SVG path")
    ap.add_argument("--title", default="")
    ap.add_argument("--label-key", default="backend", help="result field naming the engine (default backend)")
    a = ap.parse_args(argv)
    rows = load(a.inputs)
    if not rows:
        sys.exit("no benchmark results found in " + " ".join(a.inputs))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = collections.defaultdict(list)
    for r in rows:
        groups[str(r.get(a.label_key) or os.path.basename(r["_file"]))].append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for label, rs in sorted(groups.items()):
        rs.sort(key=lambda r: r.get("max_concurrency") or 1 << 30)
        tput = [r["output_throughput"] / max(1, r.get("num_gpus") or 1) for r in rs]
        inter = [1000.0 / r["median_tpot_ms"] if r.get("median_tpot_ms") else 0 for r in rs]
        e2e = [r["median_e2el_ms"] / 1000.0 for r in rs]
        ax1.plot(inter, tput, marker="o", label=label)
        ax2.plot(e2e, tput, marker="o", label=label)
        for x, y, r in zip(inter, tput, rs):
            ax1.annotate(str(r.get("max_concurrency") or "inf"), (x, y), textcoords="offset points", xytext=(4, 4),
                         fontsize=7)
    ax1.set_xlabel("interactivity (tokens/s/user)")
    ax1.set_ylabel("output throughput per GPU (tokens/s)")
    ax1.set_title("throughput vs interactivity (labels: concurrency)")
    ax2.set_xlabel("median end-to-end latency (s)")
    ax2.set_ylabel("output throughput per GPU (tokens/s)")
    ax2.set_title("throughput vs end-to-end latency")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend()
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(a.output)


if __name__ == "__main__":
    main()
