"""Issue 35's goals for the scale run, read from its results (scale.json): benchmarks/gpu_scale.py prints them at the
end of a run, benchmarks/scale_plot.py draws them.

    rows = goal_rows(json.loads(Path("scale.json").read_text()))   # [{"goal", "value", "limit", "met"}]
    x = figure(results, ("gate", "wall_seconds"))                    # a number, or None where not measured
    print_goals(results)                                             # one aligned line per goal
"""

from __future__ import annotations

# issue 35's goals: (name, path into the results, limit, whether the figure must be at least the limit)
GOALS = (
    ("decode at batch 1 / int4 roofline", ("decode", "batch1_vs_roofline"), 0.5, True),
    ("decode at batch 1 / transformers eager bf16", ("decode", "batch1_vs_eager"), 10.0, True),
    ("whole gate, cold (s)", ("gate", "wall_seconds"), 180.0, False),
    ("quantize (s)", ("seconds", "quantize"), 600.0, False),
    ("parity: engine vs checkpoint KL p99", ("gate", "parity_kl_p99"), 0.01, False),
    ("eval scoring MFU, candidate", ("gate", "shadow_mfu", "candidate_eval_scoring"), 0.4, True),
    ("eval scoring MFU, baseline", ("gate", "shadow_mfu", "baseline_eval_scoring"), 0.4, True),
    ("shadow scoring MFU, baseline teacher-forced", ("gate", "shadow_mfu", "baseline_teacher_forced"), 0.4, True),
)


def figure(r: dict, path: tuple[str, ...]) -> float | None:
    """The number at `path` in the results `r`, or None where the run did not measure it (a phase failed or was
    skipped)."""
    for key in path:
        r = r.get(key) if isinstance(r, dict) else None
    return r if isinstance(r, int | float) and not isinstance(r, bool) else None


def goal_rows(r: dict) -> list[dict]:
    """Each goal of GOALS with its figure from the results `r` and whether it is met; a figure this run did not
    measure is None, and so is its `met`."""
    rows = []
    for name, path, limit, at_least in GOALS:
        value = figure(r, path)
        met = None if value is None else (value >= limit if at_least else value <= limit)
        rows.append({"goal": name, "value": value, "limit": (">= " if at_least else "<= ") + f"{limit:g}", "met": met})
    return rows


def print_goals(r: dict) -> None:
    """One line per goal of the results `r`: figure, limit and verdict, aligned, for a log read without the JSON."""
    print(f"goals (set for the 8b shape on one H100; this run: {r.get('shape')} on {r.get('device')}):", flush=True)
    if r.get("gate") and "shadow_mfu_2n" not in r["gate"]:  # a run before model FLOPs were counted
        print("MFU in this run is 2 x all parameters per real token, not model FLOPs (about 3-4% higher)", flush=True)
    for g in goal_rows(r):
        verdict = {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]
        value = "-" if g["value"] is None else f"{g['value']:.4g}"
        print(f"goal  {g['goal']:46s} {value:>10s}  {g['limit']:>8s}  {verdict}", flush=True)
