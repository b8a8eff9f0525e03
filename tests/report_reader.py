"""Reads a ``vpipe bench`` report.md back and lists every statement that another part of the
same report contradicts: the verdict against the summary table, intervals against their
verdicts, the setup table against itself, the plan's words against its table."""

from __future__ import annotations

import re


def sections(md: str) -> dict[str, str]:
    """Each ``## title``'s body."""
    parts = re.split(r"^## (.+)$", md, flags=re.M)
    return {parts[i].strip(): parts[i + 1].strip() for i in range(1, len(parts), 2)}


def table(body: str) -> list[dict[str, str]]:
    """The first Markdown table of a section's body, as rows of cells by column."""
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    if len(lines) < 2:
        return []
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True))
            for ln in lines[2:]]  # fmt: skip


def contradictions(md: str) -> list[str]:
    """Every contradiction found in one report, in words (empty: none)."""
    s = sections(md)
    found: list[str] = []
    summary = table(s.get("Summary", ""))
    for line in s.get("Verdict", "").splitlines():
        m = re.match(r"M=(\d+) (\w+): run (\S+): [\d.]+x faster than (\S+), the next fastest", line)
        if not m:
            continue
        rows = [r for r in summary if r["M"] == m[1] and r["impl"] == m[2]]
        order = sorted(rows, key=lambda r: float(r["step ms (median)"]))
        names = [r["schedule"] for r in order]
        if names[:2] != [m[3], m[4]]:
            found.append(f"verdict names {m[3]} then {m[4]}; the summary's medians order {names}")
    for title, body in s.items():
        for row in table(body):
            ci, verdict = row.get("95% CI", ""), row.get("verdict", "")
            if ci and verdict in ("faster", "slower", "vpipe faster", "torch faster"):
                low, high = (float(x) for x in ci.split("-"))
                if low <= 1 <= high:
                    found.append(f"{title}: '{verdict}' beside a printed interval {ci} that holds 1")
    for line in s.get("Verdict", "").splitlines():
        if "faster than" in line and (ci := re.search(r"95% CI ([\d.]+)-([\d.]+)", line)):
            if float(ci[1]) <= 1:
                found.append(f"verdict '{line[:40]}...' prints an interval {ci[0]} that holds 1")
    for row in table(s.get("Setup", "")):
        if row["value"] == "null":
            found.append(f"setup: {row['field']} is null")
        if row["field"] in ("blocks", "steps", "rounds"):
            found.append(f"setup: '{row['field']}' without saying which of its meanings")
    for title, body in s.items():
        heads = table(body)[0].keys() if table(body) else []
        if "peak MiB" in heads:
            found.append(f"{title}: a 'peak MiB' column without saying what it measured")
    plan = s.get("Plan for this host", "")
    if plan:
        found += _plan(plan, s)
    return found


def _plan(plan: str, s: dict[str, str]) -> list[str]:
    found = []
    rows = table(plan)
    stated = re.search(r"Predicted step times: ±([\d.]+)%", plan)
    band = re.search(r"([\d.]+)% (?:of the fastest )?\(the error measured on the sweep\)", plan)
    if band and (not stated or band[1] != stated[1]):
        found.append(f"plan's tie band {band[1]}% is called the measured error, which it states "
                     f"as {stated[1] if stated else 'nothing'}")  # fmt: skip
    if "default band" in plan and "Predicted step times: error unknown" not in plan:
        found.append("plan uses the default tie band while stating a measured error")
    swept = re.search(r"the sweep ran M=([\d, ]+);", plan)
    rec = re.search(r"Recommended: .*? and (\d+) microbatch", plan)
    measured_fits = [r for r in rows if r.get("M measured") == "yes" and r.get("fits") == "yes"]
    if swept and rec and measured_fits and rec[1] not in swept[1].split(", "):
        found.append(f"plan recommends M={rec[1]}, which the sweep (M={swept[1]}) did not run")
    for fam in re.findall(r"Left out ([\w-]+):", plan):
        if any(r["schedule"] == fam for r in rows):
            found.append(f"plan leaves out {fam} and lists it")
    for fam, got in re.findall(r"Left out ([\w-]+): [^.]*?got (\d+)", plan):
        spr = {r["stages/rank"] for r in rows if r["schedule"] != fam}
        if str(int(got) + 1) in spr and "every program" not in plan:
            found.append(f"plan says {fam} got {got} stages per rank beside rows with more")
    if any(r["schedule"] == "auto" for r in rows) and "auto:" not in plan:
        found.append("plan lists auto rows without saying what auto is")
    if rows and "M measured" not in rows[0]:
        found.append("plan table does not say which M the sweep measured")
    return found
