"""A fault campaign's log (tools/campaign.py --log) in a few lines of Markdown: scenarios run,
skipped and failed (with their replay commands), and per fault the steps lost and the recovery times
measured."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path


def summarise(log: Path) -> str:
    results = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    ran = [r for r in results if not r.get("skipped")]
    failed = [r for r in ran if r["fails"]]
    lines = [
        f"{len(results)} scenarios: {len(ran)} ran, {len(results) - len(ran)} skipped (flags the "
        f"uninterrupted run refused), {len(failed)} failed, "
        f"{sum(1 for r in ran if not r.get('faults'))} ended before their fault's event."
    ]
    for r in failed:
        lines.append(
            f"- FAIL seed {r['seed']} ({r['describe']}): {'; '.join(r['fails'])[:400]} -- replay: "
            f"`python tools/campaign.py --scenario_seed {r['seed']}`"
        )
    per, pooled = defaultdict(list), defaultdict(list)
    for r in ran:
        for f in r.get("faults", []):
            per[(f["fault"], r["scenario"]["layout"] if "scenario" in r else "?")].append(f)
            pooled[(f["fault"], "all")].append(f)
    for groups in (per, pooled):
        lines += [
            "",
            (
                "| fault | layout | injected | steps lost (max) | recovery s: median | max | n"
                " measured |"
            ),
            "|---|---|---|---|---|---|---|",
        ]
        for (fault, layout), fs in sorted(groups.items()):
            rec = [f["recovery_s"] for f in fs if f.get("recovery_s") is not None]
            lost = [f["lost"] for f in fs if f.get("lost") is not None]
            lines.append(
                f"| {fault} | {layout} | {len(fs)} | {max(lost) if lost else '-'} |"
                f" {round(statistics.median(rec), 1) if rec else '-'} | {max(rec) if rec else '-'}"
                f" | {len(rec)} |"
            )
    return "\n".join(lines)
