"""Worlds side by side on the figures a shipped world must beat, from their eval_world reports.

    python -m scripts.compare_worlds eval/shipped/eval.json eval/flat/eval.json [--names shipped flat]

Prints one Markdown table: a row per figure, a column per world, the target last; every figure is
the report's own (± one standard error over its levels where it has one). Under the table, each
world after the first is set against the first: the figures (all that have a direction) on which
it is not better, or that it beats the first on every one.

Levels differ far more than worlds do, so a figure's standard error over levels hides most
differences between worlds. Where a report scored levels the first one did too (the same policy,
from the same frame), a second table gives, for each figure kept level by level, the mean of the
per-level differences against the first world over those levels, with its own standard error: a
difference more than twice it is marked *, one that other levels would likely repeat.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (row, how to read it from a report, better: "higher" or "lower", target or None)
FIGURES = [
    ("teacher-forced PSNR (dB)", lambda r: r["teacher_forced_psnr"], "higher", None),
    ("repeat the last real frame (dB)", lambda r: r["copy_previous_psnr"], None, None),
    ("teacher-forced minus repeating (dB)", lambda r: r["teacher_forced_psnr"] - r["copy_previous_psnr"], "higher", 2.0),
    ("AR PSNR at frame 16 (dB)", lambda r: r["ar_psnr_at_16"], "higher", 22.0),
    ("layout score at frame 64 (dB)", lambda r: r.get("layout_psnr_at_64"), "higher", 20.0),
    ("turn following, one step from the simulator's frames", lambda r: r["turn_following_teacher_forced"], "higher", 0.6),
    ("turn following, rollout", lambda r: r["turn_following"], "higher", None),
    ("action gap, frames 5-32 (dB)", lambda r: r["action_gap_db"], "higher", 2.0),
    ("action gap, lowest level (dB)", lambda r: min(r["per_level"]["action_gap_db"]), "higher", 0.0),
    ("walk and turn: least sharp frame (sharpness ratio)", lambda r: r["walk_and_turn"]["sharpness_ratio_min"],
     "higher", 0.5),
    ("walk and turn: mean sharpness ratio", lambda r: sum(r["walk_and_turn"]["sharpness_ratio"]) /
     len(r["walk_and_turn"]["sharpness_ratio"]), "higher", None),
    ("turn in place: least sharp frame", lambda r: r["turn_in_place"]["sharpness_ratio_min"], "higher", None),
]
ERRORS = {"teacher-forced PSNR (dB)": "teacher_forced_psnr", "AR PSNR at frame 16 (dB)": "ar_psnr_at_16",
          "layout score at frame 64 (dB)": "layout_psnr_at_64", "action gap, frames 5-32 (dB)": "action_gap_db"}


# figures a report keeps level by level: (row, how to read the per-level list)
PER_LEVEL = [
    ("teacher-forced PSNR (dB)", lambda r: r["per_level"]["teacher_forced_psnr"]),
    ("AR PSNR at frame 16 (dB)", lambda r: r["per_level"]["ar_psnr_at_16"]),
    ("layout score at frame 64 (dB)", lambda r: r["per_level"]["layout_psnr_at_64"]),
    ("action gap, frames 5-32 (dB)", lambda r: r["per_level"]["action_gap_db"]),
    ("turn following, one step from the simulator's frames",
     lambda r: r["turn_following_per_level"]["turn_following_teacher_forced"]),
    ("turn following, rollout", lambda r: r["turn_following_per_level"]["turn_following"]),
    ("walk and turn: least sharp frame (sharpness ratio)",
     lambda r: r["walk_and_turn"]["sharpness_ratio_min_per_level"]),
]


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of b - a level by level (two levels at least), and its standard error."""
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    return mean, (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5


def common_levels(a: dict, b: dict) -> list[int]:
    """The levels two reports both scored, played the same way from the same frame (none otherwise)."""
    if not a.get("seeds") or any(a.get(k) != b.get(k) for k in ("policy", "start")):
        return []
    theirs = set(b.get("seeds") or ())
    return [s for s in a["seeds"] if s in theirs]


def paired_table(reports: list[dict], names: list[str]) -> str | None:
    """Per-level differences against the first world, over the levels each shares with it."""
    base = reports[0]
    columns = [(r, n, common) for r, n in zip(reports[1:], names[1:]) if len(common := common_levels(base, r)) >= 2]
    if not columns:
        return None
    lines = ["| difference against " + names[0] + " | " +
             " | ".join(f"{n} ({len(common)} levels)" for _, n, common in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for name, read in PER_LEVEL:
        cells = []
        for report, _, common in columns:
            a, b = value(base, read), value(report, read)
            if not a or not b or len(a) != len(base["seeds"]) or len(b) != len(report["seeds"]):
                cells.append("not measured")
                continue
            mine, theirs = dict(zip(base["seeds"], a)), dict(zip(report["seeds"], b))
            levels = [s for s in common if mine[s] is not None and theirs[s] is not None]  # a share may be None
            if len(levels) < 2:
                cells.append("not measured")
                continue
            mean, error = paired([mine[s] for s in levels], [theirs[s] for s in levels])
            cells.append(f"{mean:+.2f} ± {error:.2f}" + (" *" if abs(mean) > 2 * error else ""))
        if any(c != "not measured" for c in cells):  # a figure older reports did not keep level by level
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cell(report: dict, name: str, read) -> str:
    number = value(report, read)
    if number is None:
        return "not measured"
    error = report.get("standard_error", {}).get(ERRORS.get(name, ""))
    return f"{number:.2f}" + (f" ± {error:.2f}" if error is not None else "")


def table(reports: list[dict], names: list[str]) -> str:
    lines = ["| figure | " + " | ".join(names) + " | target |", "|---|" + "---|" * (len(names) + 1)]
    for name, read, better, target in FIGURES:
        goal = "" if target is None else f"{'>=' if better == 'higher' else '<='} {target:g}"
        lines.append(f"| {name} | " + " | ".join(cell(r, name, read) for r in reports) + f" | {goal} |")
    return "\n".join(lines)


def value(report: dict, read):
    try:
        return read(report)
    except (KeyError, TypeError, ValueError):
        return None


def verdicts(reports: list[dict], names: list[str]) -> list[str]:
    """For each world after the first: the figures with a direction on which it is not better."""
    out = []
    for report, name in zip(reports[1:], names[1:]):
        worse = []
        for figure, read, better, _ in FIGURES:
            if better is None:
                continue
            a, b = value(reports[0], read), value(report, read)
            if a is None or b is None or (b <= a if better == "higher" else b >= a):
                worse.append(figure)
        out.append(f"{name} beats {names[0]} on every figure" if not worse else
                   f"{name} is not better than {names[0]} on: {'; '.join(worse)}")
    return out


def report_name(path: Path) -> str:
    """eval_world writes NAME/eval.json; the reports kept in docs are NAME_eval.json."""
    if path.name == "eval.json":
        return path.resolve().parent.name
    return path.name.removesuffix(".json").removesuffix("_eval") or path.name


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="eval.json files written by scripts.eval_world")
    p.add_argument("--names", nargs="+", default=None,
                   help="column names (default: each report's folder for eval.json, else its file name less _eval.json)")
    args = p.parse_args(argv)
    names = args.names or [report_name(Path(r)) for r in args.reports]
    if len(names) != len(args.reports):
        p.error(f"--names gives {len(names)} names for {len(args.reports)} reports")
    reports = []
    for path in args.reports:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            p.error(f"report {path!r} could not be read as eval_world's eval.json: {exc}")
    print(table(reports, names))
    for line in verdicts(reports, names):
        print("\n" + line)
    if differences := paired_table(reports, names):
        print("\nOn the levels each world shares with the first, level by level (± one standard error of the "
              f"differences; *: more than twice it):\n\n{differences}")
    unpaired = [n for r, n in zip(reports[1:], names[1:]) if len(common_levels(reports[0], r)) < 2]
    if unpaired and reports[0].get("seeds"):  # an older report without its levels pairs with none
        print(f"\nNot set against {names[0]} level by level (fewer than 2 of its levels, or another policy or "
              f"first frame): {', '.join(unpaired)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
