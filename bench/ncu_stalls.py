"""Where a kernel's warps wait: Nsight Compute's per-instruction warp-stall samples, summed by reason and
listed for the hottest instructions (with the instructions just before them, to tell which wait loop it is).

    ncu --clock-control none --profile-from-start off --section WarpStateStats --section SourceCounters \\
        --metrics smsp__pcsamp_sample_count --page source --print-source sass --csv \\
        python3 bench/ncu_products.py ws_product > ws_product_sass.csv
    python3 bench/ncu_stalls.py ws_product_sass.csv            # also reads a .csv.gz

Columns: share of all samples, address, SASS, and the instruction's top stall reasons (sample counts).
"""

from __future__ import annotations

import argparse
import csv
import gzip
from pathlib import Path


def read_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """The per-instruction table (header, rows) of an ``ncu --page source --csv`` dump."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    return rows[start], [row for row in rows[start + 1:] if len(row) == len(rows[start])]


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--context", type=int, default=2, help="instructions shown before each hot one")
    args = parser.parse_args()
    header, rows = read_rows(args.csv)
    samples = header.index("Warp Stall Sampling (All Samples)")
    source = header.index("Source")
    executed = header.index("Instructions Executed")
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]
    total = sum(number(row[samples]) for row in rows)
    by_reason = {header[i]: sum(number(row[i]) for row in rows) for i in reasons}
    print(f"{int(total)} samples over {len(rows)} instructions; by reason:")
    for name, count in sorted(by_reason.items(), key=lambda item: -item[1]):
        if count:
            print(f"  {name:<24} {100 * count / total:5.1f}%")
    print(f"\n{'share':>6} {'address':>8} {'executed':>9}  instruction / top reasons")
    order = sorted(range(len(rows)), key=lambda k: -number(rows[k][samples]))[: args.top]
    for k in order:
        row = rows[k]
        top = sorted(((number(row[i]), header[i]) for i in reasons), reverse=True)[:2]
        for before in rows[max(0, k - args.context):k]:
            print(f"{'':>6} {before[0][-6:]:>8} {int(number(before[executed])):9d}  {before[source][:70]}")
        print(f"{100 * number(row[samples]) / total:5.1f}% {row[0][-6:]:>8} {int(number(row[executed])):9d}  "
              f"{row[source][:70]}  {[(name, int(count)) for count, name in top if count]}")


if __name__ == "__main__":
    main()
