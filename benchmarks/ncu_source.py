"""Where a kernel's warps wait, from ncu's source page: stall samples by reason, by opcode and by
instruction.

Reads ``ncu -i REPORT.ncu-rep --page source --csv --print-source sass`` (a report taken with the
``SourceCounters`` section; ``revisions_for_ncu.py`` says how) and prints, for each kernel in it,
the share of its stall samples per reason, per opcode, and the instructions that hold the most,
each with its two main reasons. It found the eighty-fourth round's two changes to the Triton
kernels (NOTES.md): a read of delta's shared-memory copy left after dP's wait, and the forward's
row-sum shuffles.

    python3 benchmarks/ncu_source.py source.csv [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def kernels(path: Path) -> dict[str, list[dict[str, str]]]:
    """kernel name -> its instructions' rows (each ``Kernel Name`` line starts a kernel's table;
    launches of one kernel are counted together)."""
    found: dict[str, list[dict[str, str]]] = {}
    rows = list(csv.reader(path.open()))
    i = 0
    while i < len(rows):
        if rows[i][:1] != ["Kernel Name"]:
            i += 1
            continue
        name, header, i = rows[i][1], rows[i + 1], i + 2
        body = found.setdefault(name, [])
        while i < len(rows) and rows[i][:1] != ["Kernel Name"]:
            if len(rows[i]) == len(header):
                body.append(dict(zip(header, rows[i], strict=True)))
            i += 1
    if not found:
        raise ValueError(f"{path}: no 'Kernel Name' line; not ncu's source page as CSV")
    return found


def opcode(source: str) -> str:
    """``"@!P0 LDGSTS.E.BYPASS.128 ..."`` -> ``"LDGSTS"``."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def reasons(row: dict[str, str]) -> collections.Counter[str]:
    return collections.Counter(
        {
            k.removeprefix("stall_"): _number(v)
            for k, v in row.items()
            if k.startswith("stall_") and "Not Issued" not in k
        }
    )


def summary(name: str, body: list[dict[str, str]], top: int) -> str:
    total = sum(_number(r[SAMPLES]) for r in body) or 1.0
    by_reason: collections.Counter[str] = collections.Counter()
    by_opcode: collections.Counter[str] = collections.Counter()
    for r in body:
        by_reason.update(reasons(r))
        by_opcode[opcode(r["Source"])] += _number(r[SAMPLES])
    lines = [
        f"== {name}: {len(body)} instructions, {total:.0f} samples",
        "  reasons: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_reason.most_common(8)),
        "  opcodes: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_opcode.most_common(12)),
    ]
    for r in sorted(body, key=lambda r: -_number(r[SAMPLES]))[:top]:
        main = ", ".join(f"{k} {v:.0f}" for k, v in reasons(r).most_common(2) if v)
        lines.append(
            f"  {r['Address'][-5:]} {_number(r[SAMPLES]) / total:6.2%}"
            f"  {r['Source'].strip()[:60]:60s}  {main}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=20, help="instructions listed a kernel")
    args = parser.parse_args()
    try:
        found = kernels(args.csv)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    for name, body in found.items():
        print(summary(name, body, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
