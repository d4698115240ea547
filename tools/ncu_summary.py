#!/usr/bin/env python3
"""Summarise an `ncu --csv --metrics gpu__time_duration.sum` log: per kernel name, launches,
total and mean time, in launch order of first appearance. Usage: ncu_summary.py LOG [SKIP]
(SKIP: ignore the first SKIP kernel launches, e.g. the prefill)."""
import csv
import sys


def main():
    path = sys.argv[1]
    skip = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "ns")
        v = float(r["Metric Value"].replace(",", ""))
        us = v / 1000.0 if unit == "nsecond" or unit == "ns" else v if unit in ("usecond", "us") else v * 1000.0
        name = r["Kernel Name"].split("(")[0]
        rows.append((name, us, r.get("Grid Size", ""), r.get("Block Size", "")))
    rows = rows[skip:]
    agg = {}
    for name, us, grid, blk in rows:
        key = (name, grid)
        a = agg.setdefault(key, [0, 0.0, blk])
        a[0] += 1
        a[1] += us
    total = sum(a[1] for a in agg.values())
    print(f"{len(rows)} launches, {total:.1f} us in all")
    for (name, grid), (cnt, us, blk) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"{us:10.1f} us {cnt:6d} x {us / cnt:8.2f} us  {100 * us / total:5.1f}%  {name[:60]:60s} grid {grid} blk {blk}")


main()
