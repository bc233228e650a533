#!/usr/bin/env python3
"""Two builds' moor-bench runs side by side: each figure's median per build and their ratio.

    python3 bench/compare.py BASE_LABEL WORK_LABEL base1.json,base2.json,... work1.json,...

Prints a Markdown table (what docs/benchmarks.md carries). The ratio is work / base: above
1 is more of the figure on the working tree (faster for a rate, costlier for CPU or ms).
"""
import statistics
import sys

from median import load, rows, values


def main(base_label, work_label, base_paths, work_paths):
    base = [load(p) for p in base_paths.split(",") if p]
    work = [load(p) for p in work_paths.split(",") if p]
    print(f"| figure | {base_label} median (runs) | {work_label} median (runs) | ratio |")
    print("|---|---|---|---|")
    for name, get, fmt in rows(base + work):
        b, w = values(base, get), values(work, get)
        if b is None or w is None or not b or not w:
            continue
        mb, mw = statistics.median(b), statistics.median(w)
        ratio = f"{mw / mb:.2f}" if mb else "n/a"
        show = lambda m, vs: f"{fmt.format(m)} ({', '.join(fmt.format(v) for v in vs)})"
        print(f"| {name} | {show(mb, b)} | {show(mw, w)} | {ratio} |")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
