"""Worlds side by side on the figures a shipped world must beat, from their eval_world reports.

    python -m scripts.compare_worlds eval/shipped/eval.json eval/flat/eval.json [--names shipped flat]

Prints one Markdown table: a row per figure, a column per world, the target last; every figure is
the report's own (± one standard error over its levels where it has one). Under the table, each
world after the first is set against the first: the figures (all that have a direction) on which
it is not better, or that it beats the first on every one.

Levels differ far more than worlds do, so a figure's standard error over levels hides most
differences between worlds. Where a report scored at least three levels the first one did too (the
same policy, from the same recorded first frame), a second table gives, for each figure kept level
by level and scored the same way, the mean of the per-level differences against the first world
over those levels, with its own standard error (turn following: each level's slide of the view in
columns per frame, over the simulator's mean slide on those levels, so that the mean difference is
the difference of the two shares over those levels, and a level where the simulator's view barely
slides does not swamp the others as its own share would); * marks a mean past the two-sided 95%
point of Student's t for that many levels (2.36 errors for 8). Among many cells a few marks come by
chance: read a mark against another set of levels.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

TF, AR16, LAYOUT, GAP = "teacher-forced PSNR (dB)", "AR PSNR at frame 16 (dB)", "layout score at frame 64 (dB)", \
    "action gap, frames 5-32 (dB)"
TURN_ONE, TURN_ROLL = "turn following, one step from the simulator's frames", "turn following, rollout"
LEAST_SHARP = "walk and turn: least sharp frame (sharpness ratio)"
# (row, how to read it from a report, better: "higher" or "lower", target or None)
FIGURES = [
    (TF, lambda r: r["teacher_forced_psnr"], "higher", None),
    ("repeat the last real frame (dB)", lambda r: r["copy_previous_psnr"], None, None),
    ("teacher-forced minus repeating (dB)", lambda r: r["teacher_forced_psnr"] - r["copy_previous_psnr"], "higher", 2.0),
    (AR16, lambda r: r["ar_psnr_at_16"], "higher", 22.0),
    (LAYOUT, lambda r: r.get("layout_psnr_at_64"), "higher", 20.0),
    (TURN_ONE, lambda r: r["turn_following_teacher_forced"], "higher", 0.6),
    (TURN_ROLL, lambda r: r["turn_following"], "higher", None),
    (GAP, lambda r: r["action_gap_db"], "higher", 2.0),
    ("action gap, lowest level (dB)", lambda r: min(r["per_level"]["action_gap_db"]), "higher", 0.0),
    (LEAST_SHARP, lambda r: r["walk_and_turn"]["sharpness_ratio_min"],
     "higher", 0.5),
    ("walk and turn: mean sharpness ratio", lambda r: sum(r["walk_and_turn"]["sharpness_ratio"]) /
     len(r["walk_and_turn"]["sharpness_ratio"]), "higher", None),
    ("turn in place: least sharp frame", lambda r: r["turn_in_place"]["sharpness_ratio_min"], "higher", None),
]
ERRORS = {TF: "teacher_forced_psnr", AR16: "ar_psnr_at_16", LAYOUT: "layout_psnr_at_64", GAP: "action_gap_db"}


SIM_SLIDE = lambda r: r["turn_shift_per_level"]["sim"]  # noqa: E731
# figures a report keeps level by level: (row of FIGURES, how to read the per-level list, the
# report keys that say how it was scored: two reports pair on the row only where these agree, and
# how to read the per-level list whose mean over the paired levels scales the figure, or None)
PER_LEVEL = [
    (TF, lambda r: r["per_level"]["teacher_forced_psnr"], ("tf_frames",), None),
    (AR16, lambda r: r["per_level"]["ar_psnr_at_16"], (), None),
    (LAYOUT, lambda r: r["per_level"]["layout_psnr_at_64"], (), None),
    (GAP, lambda r: r["per_level"]["action_gap_db"], ("gap_range",), None),
    (TURN_ONE, lambda r: r["turn_shift_per_level"]["teacher_forced"], ("turn_dx", "turn_frames"), SIM_SLIDE),
    (TURN_ROLL, lambda r: r["turn_shift_per_level"]["model"], ("turn_dx", "turn_frames"), SIM_SLIDE),
    (LEAST_SHARP, lambda r: r["walk_and_turn"]["sharpness_ratio_min_per_level"], ("walk_and_turn/frames",), None),
]
MIN_LEVELS = 3  # fewer leave the error of a difference all but unknown
# two-sided 95% points of Student's t by degrees of freedom (levels - 1); a count between two rows
# takes the smaller one's, the larger point
T_95 = {2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 12: 2.179,
        15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def scored(report: dict, key: str):
    """A report's entry at ``key`` ("a/b": an entry of a section), None where it has none."""
    for part in key.split("/"):
        report = report.get(part) if isinstance(report, dict) else None
    return report


def t_95(dof: int) -> float:
    return T_95[max(k for k in T_95 if k <= dof)]


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of b - a level by level (two levels at least), and its standard error."""
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    return mean, (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5


def pairing(a: dict, b: dict) -> tuple[list[int], str | None]:
    """The levels report ``b`` shares with ``a``, played the same way from the same frame, or why none."""
    for key in ("policy", "start"):
        if a.get(key) is None or b.get(key) is None:
            return [], f"no {key} recorded"
        if a[key] != b[key]:
            return [], f"{key} {b[key]!r}, not {a[key]!r}"
    theirs = set(b.get("seeds") or ())  # an older report lists none
    common = [s for s in a["seeds"] if s in theirs]
    if len(common) < MIN_LEVELS:
        return [], f"{len(common)} shared levels (pairing takes {MIN_LEVELS})"
    return common, None


def per_level_values(report: dict, read) -> dict | None:
    """{level seed: number or None} for a figure the report keeps level by level, else None."""
    values = value(report, read)
    if not isinstance(values, list) or len(values) != len(report["seeds"]):
        return None
    ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    return {s: (v if ok(v) else None) for s, v in zip(report["seeds"], values)}


def scaled(values: dict, by: dict | None, levels: list[int]) -> list[float] | None:
    """``values`` on ``levels``, over the mean of ``by`` on them where given (None if that is not positive)."""
    if by is None:
        return [values[s] for s in levels]
    mean = sum(by[s] for s in levels) / len(levels)
    return [values[s] / mean for s in levels] if mean > 0 else None


def paired_table(reports: list[dict], names: list[str]) -> tuple[str | None, list[str]]:
    """Per-level differences against the first world over the levels each shares with it, and
    for each report left out, why."""
    base, columns, left_out = reports[0], [], []
    for report, name in zip(reports[1:], names[1:]):
        common, why = pairing(base, report)
        if why:
            left_out.append(f"{name} ({why})")
        else:
            columns.append((report, name, common))
    if not columns:
        return None, left_out
    lines = []
    for row, read, keys, scale in PER_LEVEL:
        cells = []
        for report, _, common in columns:
            reads = (read, scale) if scale else (read,)
            lists = [[per_level_values(r, f) for f in reads] for r in (base, report)]
            levels = [s for s in common if all(v and v[s] is not None for per in lists for v in per)]
            if any(scored(base, k) != scored(report, k) for k in keys) or len(levels) < MIN_LEVELS:
                cells.append("not measured")  # scored another way, or not kept level by level
                continue
            mine, theirs = (scaled(per[0], per[1] if scale else None, levels) for per in lists)
            if mine is None or theirs is None:
                cells.append("not measured")  # nothing to scale by: the simulator's view did not slide
                continue
            mean, error = paired(mine, theirs)
            cells.append(f"{mean:+.2f} ± {error:.2f}" + (" *" if abs(mean) > t_95(len(levels) - 1) * error else ""))
        if any(c != "not measured" for c in cells):  # a figure older reports did not keep level by level
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    if not lines:
        return None, left_out
    head = ["| difference against " + names[0] + " | " +
            " | ".join(f"{n} ({len(common)} levels)" for _, n, common in columns) + " |",
            "|---|" + "---|" * len(columns)]
    return "\n".join(head + lines), left_out


def check_report(report, path: str) -> str | None:
    """Why ``report`` is not an eval_world report compare_worlds can read, or None."""
    if not isinstance(report, dict):
        return f"report {path!r} holds a JSON {type(report).__name__}, not eval_world's report object"
    seeds = report.get("seeds")
    if seeds is None:
        return None  # an older report: set side by side, not level by level
    if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        return f"report {path!r}: 'seeds' is {seeds!r}; expected a list of level seeds (rerun scripts.eval_world)"
    if len(set(seeds)) != len(seeds):
        return f"report {path!r}: 'seeds' {seeds} names a level twice; each level is scored once (rerun scripts.eval_world)"
    return None


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
        return path.absolute().parent.name
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
        if problem := check_report(reports[-1], path):
            p.error(problem)
    print(table(reports, names))
    for line in verdicts(reports, names):
        print("\n" + line)
    if not reports[0].get("seeds"):
        if len(reports) > 1:
            print(f"\nNo level-by-level table: {names[0]}'s report does not list its levels (made before it did)")
        return 0
    differences, left_out = paired_table(reports, names)
    if differences:
        print(f"\nOn the levels each world shares with the first, level by level (± one standard error of the "
              f"differences; *: past the two-sided 95% point of Student's t for the number of levels):\n\n{differences}")
    if left_out:
        print(f"\nNot set against {names[0]} level by level: {'; '.join(left_out)}")
    other = [n for r, n in zip(reports[1:], names[1:]) if r.get("settings") and r.get("settings") != reports[0].get("settings")]
    if other and reports[0].get("settings"):
        print(f"\nScored with other settings than {names[0]} (dtype, threads, kernels: a small difference may be "
              f"theirs): {', '.join(other)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
