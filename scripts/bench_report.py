#!/usr/bin/env python3
"""Turns `flashkda bench` JSON (one run, or two runs of the same build) into the Markdown table
recorded in bench/results/, and optionally a plot (PNG) of each case against its floor and the
peers' figures.

GPU runs: beside our median, the reference figures of docs/benchmark.md (one H200, same shapes):
the floor, the fastest peer, FlashKDA (the original CUDA kernel), the FlashKDA fork, Triton (fla),
the done-when and goal times, and our speedup over the fastest peer; the floor measured in the
run is printed too. The decode cases (D1-D4) get a table of their own: our median against the
floor, the share of the copy bandwidth, the goal (relative to the floor measured in the run) and
the time of the prefill path before the decode kernel. The serving rows (P1-pool, P1-ckpt,
P1-softplus and the like) get a table of their own too: our median against that of the case each
derives from in the same run, whose goal is a ratio of at most 1.10. CPU runs (scaled-down shapes)
have no floor, bandwidth or peer columns.

usage: bench_report.py RUN.json [REPEAT.json] [--plot PLOT.png] > h200.md

The plot needs matplotlib (`pip install matplotlib`); without it the script says so on stderr and
still prints the Markdown.
"""
import argparse
import json
import math
import os
import sys
import textwrap

# docs/benchmark.md, ms on one H200 (K = V = 128, bf16 state, safe gate): shape, reference floor,
# fastest peer, FlashKDA (original CUDA kernel), FlashKDA fork, Triton (fla), done-when, goal.
# None: no figure.
MIXED = [1300, 547, 2048, 963, 271, 3063]
REFERENCE_MS = {
    #       seq_lens          H    floor  fastest flashkda fork  triton done  goal
    "P1": ([8192], 96, 0.240, 0.921, 1.421, 0.921, 2.646, 0.70, 0.48),
    "P2": (MIXED, 96, 0.247, 0.739, 1.371, 0.739, 2.63, 0.56, 0.49),
    "P3": ([1024] * 8, 96, 0.250, 0.720, 1.175, 0.720, 2.614, 0.55, 0.50),
    "P4": ([8192], 64, 0.160, 0.825, 1.228, 0.825, 1.766, 0.47, 0.32),
    "P5": (MIXED, 64, 0.165, 0.545, 1.001, 0.545, 1.79, 0.42, 0.33),
    "P6": ([1024] * 8, 64, 0.167, 0.490, 0.793, 0.490, 1.798, 0.38, 0.33),
    "P7": ([32768], 8, 0.080, 1.489, 3.287, 2.433, 1.489, 0.50, 0.30),
    "P8": ([65536], 4, 0.079, 2.179, 6.297, 4.739, 2.179, 0.60, 0.30),
    "P9": ([128] * 64, 32, 0.111, 0.372, 0.479, 0.372, 1.001, 0.29, 0.22),
    "P10": ([16384] * 4, 16, 0.319, 1.614, 2.393, 1.614, 3.472, 0.95, 0.63),
    "P11": ([131072], 8, 0.32, None, None, None, None, 1.6, 0.8),
}
FIELDS = ("seq_lens", "heads", "floor", "fastest", "flashkda", "fork", "triton", "done_when", "goal")
# docs/benchmark.md's decode cases on one H200: requests, tokens per request, heads, pool dtype,
# the reference floor (ms) and the time of the same shape through the prefill path before the
# decode kernel ("prefill path today" there: bf16 states, contiguous); None: no figure. Their
# goal is relative to the floor measured in the run (goal_ms in the JSON).
DECODE_REFERENCE_MS = {
    #      requests tokens  H   pool    floor  before
    "D1": (256, 1, 32, "f32", 0.254, 0.536),
    "D2": (256, 1, 32, "bf16", 0.128, 0.536),
    "D3": (32, 1, 32, "f32", 0.032, None),
    "D4": (256, 4, 32, "f32", 0.64, 0.542),
}
DECODE_FIELDS = ("requests", "tokens", "heads", "pool", "floor", "before")
# docs/benchmark.md's done-when: at least this much faster than the fastest peer, and at most the
# done-when time.
DONE_SPEEDUP = 1.25
# docs/benchmark.md's goal of a serving row: its median at most this times that of the case it
# derives from (the plain safe-gate case, same run).
SERVING_GOAL_RATIO = 1.10


def reference(case):
    """The reference figures of a case (a dict of FIELDS), or None when the case is not one of
    docs/benchmark.md's or was run on another shape (a custom shape, a scaled-down CPU run)."""
    ref = REFERENCE_MS.get(case.get("name"))
    if ref is None:
        return None
    ref = dict(zip(FIELDS, ref))
    if list(case.get("seq_lens", [])) != ref["seq_lens"] or case.get("heads") != ref["heads"]:
        return None
    return ref


def decode_reference(case):
    """The reference figures of a decode case (a dict of DECODE_FIELDS), or None when the case is
    not one of docs/benchmark.md's or was run on another shape."""
    ref = DECODE_REFERENCE_MS.get(case.get("name"))
    decode = case.get("decode")
    if ref is None or decode is None:
        return None
    ref = dict(zip(DECODE_FIELDS, ref))
    shape = (decode.get("requests"), decode.get("tokens"), case.get("heads"), decode.get("pool_dtype"))
    return ref if shape == (ref["requests"], ref["tokens"], ref["heads"], ref["pool"]) else None


def is_decode(case):
    return "decode" in case


def is_serving(case):
    return "serving" in case


def serving_features(case):
    """A serving row's features in words: 'bf16 pool, 8 checkpoints', 'softplus gate'."""
    s = case["serving"]
    parts = (["bf16 pool"] if s.get("pool") else []) + \
            ([f"{s['checkpoints']} checkpoints"] if s.get("checkpoints") else []) + \
            (["softplus gate"] if s.get("gate") == "softplus" else [])
    return ", ".join(parts) or "-"


def base_of(run, case):
    """The case a serving row derives from, run on the same shape in the same run, or None."""
    for c in run["cases"]:
        if (c["name"], c.get("seq_lens"), c.get("heads")) == (case.get("derived_from"), case.get("seq_lens"),
                                                             case.get("heads")):
            return c
    return None


def goal_rule(case):
    """A decode goal in words: '>= 85% BW' (a share of the copy bandwidth) or '<= 3x floor'."""
    x = case.get("decode", {}).get("goal_x_floor")
    if not x:
        return "-"
    return f"<= {x:g}x floor" if x >= 2 else f">= {100 / x:.0f}% BW"


def fmt(x, digits=3):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


def fmt_err(x):
    return "-" if x is None else f"{x:.2e}"


def fmt_count(x):
    return "-" if x is None else f"{x:,.0f}"


def seq_text(seq):
    if len(seq) > 1 and len(set(seq)) == 1:
        return f"{len(seq)} x [{seq[0]}]"
    return str(seq).replace(" ", "")


def median(case):
    return case.get("median_ms")


def load(paths):
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    backends = {r.get("backend") for r in runs}
    if len(backends) > 1:
        sys.exit(f"bench_report.py: the runs mix backends ({', '.join(sorted(map(str, backends)))})")
    return runs


def repeat_of(runs, case):
    """The same case (name and shape) in the repeat run, or None."""
    if len(runs) < 2:
        return None
    for c in runs[1]["cases"]:
        if (c["name"], c.get("seq_lens"), c.get("heads")) == (case["name"], case.get("seq_lens"), case.get("heads")):
            return c
    return None


def error_row(cells, header):
    """A table row for a case that raised an error: its first cells, the message, empty cells."""
    columns = header.count("|") - 1
    return "| " + " | ".join(cells) + " |" + " |" * (columns - len(cells))


def overrides_text(runs):
    """The FLASHKDA_* variables the runs were measured under (JSON "overrides"), or ''."""
    seen = sorted({f"{k}={v}" for r in runs for k, v in (r.get("overrides") or {}).items()})
    return f" Measured with overrides: {', '.join(seen)} (not the library's default choices)." if seen else ""


def gpu_report(runs, paths, plot_path):
    first = runs[0]
    commits = sorted({r["commit"] for r in runs})
    out = [f"# FlashKDA on {first.get('device') or 'the GPU'}\n"]
    bw = first.get("copy_bandwidth_tbps")
    bw_text = f"device-to-device copy bandwidth {fmt(bw, 2)} TB/s measured in the run"
    if len(runs) > 1:
        bw_text += f" ({fmt(runs[1].get('copy_bandwidth_tbps'), 2)} in the repeat)"
    out.append(f"Generated by `scripts/bench_report.py` from `flashkda bench` JSON "
               f"({', '.join(os.path.basename(p) for p in paths)}); commit {', '.join(commits)}; {bw_text}."
               f"{overrides_text(runs)}\n")
    out.append("Median of CUDA-event timings of single forward calls after warm-up, inputs rotated beyond "
               "the L2, outputs poisoned and checked written (bench/README.md). `floor`: the bytes of "
               "docs/benchmark.md's formula over the copy bandwidth measured in this run; `x floor`: our "
               "median over it. Reference columns (ms, one H200, from docs/benchmark.md): `ref floor`, the "
               "`fastest peer`, `FlashKDA` (the original CUDA kernel), its `fork`, `Triton` (fla), "
               f"`done-when` (met: at least {DONE_SPEEDUP}x faster than the fastest peer and at most that "
               "time) and `goal`. `speedup`: the fastest peer's time over ours; with a repeat, the slower "
               "of the two runs counts. Errors: fp64 oracle on two heads of every sequence, bar 3e-3.\n")
    lines, rows = [], []
    prefill = [c for c in first["cases"] if not is_decode(c) and not is_serving(c)]
    decode = [c for c in first["cases"] if is_decode(c)]
    serving = [c for c in first["cases"] if is_serving(c)]
    if prefill or not (decode or serving):
        lines += prefill_table(runs, prefill, rows)
    if decode:
        lines += decode_table(runs, decode, rows)
    if serving:
        lines += serving_table(runs, serving, rows, gpu=True)
    # The last summary line ends the report's text.
    lines[-1] = lines[-1].rstrip("\n") + (f" All outputs written and within the error bar: "
                                          f"{all(r.get('all_pass') for r in runs)}.\n")
    out += lines
    if plot_path and plot_gpu(rows, runs, plot_path):
        out.append(f"![each case against its floor and the peers]({os.path.basename(plot_path)})\n")
    return out


def worst_of(runs, case):
    """Our median and the repeat's (or None), and the slower of the two."""
    rep = repeat_of(runs, case)
    ours, rep_ms = median(case), median(rep) if rep else None
    times = [x for x in (ours, rep_ms) if x is not None]
    return ours, rep_ms, max(times) if times else None


def prefill_table(runs, cases, rows):
    """The table of the prefill cases (P1-P11 or a custom shape); appends their plot rows."""
    out = []
    header = ("| case | seq_lens | H | median ms | repeat ms | min / max ms | TB/s | floor ms | x floor "
              "| ref floor | fastest peer | FlashKDA | fork | Triton | speedup | done-when | met | goal "
              "| err out | err state |")
    out.append(header)
    out.append("|" + "---|" * (header.count("|") - 1))
    met = beats = with_peer = with_ref = at_goal = 0
    for case in cases:
        ref = reference(case)
        ours, rep_ms, worst = worst_of(runs, case)
        speedup = done = None
        r = ref or {}
        if worst is not None and r.get("fastest"):
            speedup = r["fastest"] / worst
            with_peer += 1
            beats += speedup >= 1.0
        if worst is not None and ref is not None:
            with_ref += 1
            done = worst <= r["done_when"] and (speedup is None or speedup >= DONE_SPEEDUP)
            met += done
            at_goal += worst <= r["goal"]
        rows.append({"case": case, "ref": ref, "ours": ours, "repeat": rep_ms, "floor": case.get("floor_ms")})
        oracle = case.get("oracle", {})
        if "error" in case:
            out.append(error_row([case["name"], seq_text(case["seq_lens"]), str(case["heads"]),
                                  "error: " + case["error"].replace("|", "/")], header))
            continue
        out.append(
            f"| {case['name']} | {seq_text(case['seq_lens'])} | {case['heads']} | {fmt(ours)} | {fmt(rep_ms)} | "
            f"{fmt(case.get('min_ms'))} / {fmt(case.get('max_ms'))} | {fmt(case.get('effective_tbps'), 2)} | "
            f"{fmt(case.get('floor_ms'))} | {fmt(case.get('ratio_to_floor'), 2)} | {fmt(r.get('floor'))} | "
            f"{fmt(r.get('fastest'))} | {fmt(r.get('flashkda'))} | {fmt(r.get('fork'))} | {fmt(r.get('triton'))} | "
            f"{'-' if speedup is None else f'{speedup:.2f}x'} | {fmt(r.get('done_when'), 2)} | "
            f"{'-' if done is None else ('yes' if done else 'no')} | {fmt(r.get('goal'), 2)} | "
            f"{fmt_err(oracle.get('out_rel'))} | {fmt_err(oracle.get('final_state_rel'))} |")
    out.append(f"\n{beats} of {with_peer} cases with peer figures at or under the fastest peer; {met} of {with_ref} "
               f"cases of docs/benchmark.md meet done-when, {at_goal} of {with_ref} the goal (the slower of the runs "
               f"counts).\n")
    return out


def decode_table(runs, cases, rows):
    """The table of the decode cases (D1-D4); appends their plot rows."""
    out = ["## Decode and verify\n",
           "Requests x tokens as [N, T, H, 128] rows, the states in a pool updated in place through int32 "
           "indices (D4: every draft token's state to its own slot); the timed calls skip the host check of "
           "the index arrays (`SeqlenCheck::kDeviceGuardsOnly`). `% BW`: the floor over our median, the share "
           "of the copy bandwidth reached. `goal`: docs/benchmark.md's rule on the floor measured in this run; "
           "`met` with the slower of the runs. `before`: the same shape through the prefill path before the "
           "decode kernel (docs/benchmark.md); `speedup`: that time over ours. `err state`: the slots the "
           "checked call wrote (D4: the state after every draft token).\n"]
    header = ("| case | requests x tokens | H | pool | median ms | repeat ms | min / max ms | TB/s | floor ms "
              "| x floor | % BW | goal ms | goal | met | ref floor | before | speedup | err out | err state |")
    out.append(header)
    out.append("|" + "---|" * (header.count("|") - 1))
    at_goal = with_goal = 0
    for case in cases:
        ref = decode_reference(case) or {}
        decode = case["decode"]
        ours, rep_ms, worst = worst_of(runs, case)
        goal = case.get("goal_ms")
        met = None if worst is None or goal is None else worst <= goal
        if met is not None:
            with_goal += 1
            at_goal += met
        before = ref.get("before")
        speedup = before / worst if before and worst else None
        floor = case.get("floor_ms")
        share = 100 * floor / ours if floor and ours else None
        rows.append({"case": case, "ref": {"goal": goal, "before": before}, "ours": ours, "repeat": rep_ms,
                     "floor": floor})
        shape = f"{decode.get('requests')} x {decode.get('tokens')}"
        if "error" in case:
            out.append(error_row([case["name"], shape, str(case["heads"]), decode.get("pool_dtype", "-"),
                                  "error: " + case["error"].replace("|", "/")], header))
            continue
        oracle = case.get("oracle", {})
        out.append(
            f"| {case['name']} | {shape} | {case['heads']} | {decode.get('pool_dtype')} | {fmt(ours)} | "
            f"{fmt(rep_ms)} | {fmt(case.get('min_ms'))} / {fmt(case.get('max_ms'))} | "
            f"{fmt(case.get('effective_tbps'), 2)} | {fmt(floor)} | {fmt(case.get('ratio_to_floor'), 2)} | "
            f"{fmt(share, 0)} | {fmt(goal)} | {goal_rule(case)} | {'-' if met is None else ('yes' if met else 'no')} | "
            f"{fmt(ref.get('floor'))} | {fmt(before)} | {'-' if speedup is None else f'{speedup:.2f}x'} | "
            f"{fmt_err(oracle.get('out_rel'))} | {fmt_err(oracle.get('final_state_rel'))} |")
    out.append(f"\n{at_goal} of {with_goal} decode cases at their goal (the slower of the runs counts).\n")
    return out


def serving_table(runs, cases, rows, gpu):
    """The table of the serving rows: each against the case it derives from in the same run (the
    first run's medians); appends their plot rows."""
    out = ["## Serving rows\n",
           "Prefill cases with the features an inference engine uses, on the shape of the plain safe-gate "
           "case each derives from: a bf16 state pool of 2N slots updated in place (`pool`), fp32 prefix "
           "checkpoints, the softplus gate with Kimi-Linear-like parameters. `base ms`: the median of that "
           "case in the same run (`-` when it did not run); `ratio`: ours over it; goal (docs/benchmark.md): "
           f"within 10% (ratio <= {SERVING_GOAL_RATIO:.2f}; the plot's `goal` tick). `err state`: the written slots or final state, "
           "with the checkpoints checked.\n"]
    measured = "| TB/s | floor ms | x floor " if gpu else "| token-heads/s "
    header = (f"| case | derived from | seq_lens | H | features | median ms | repeat ms | min / max ms {measured}"
              "| base ms | ratio | within 10% | err out | err state |")
    out.append(header)
    out.append("|" + "---|" * (header.count("|") - 1))
    within = with_base = 0
    for case in cases:
        ours, rep_ms, _ = worst_of(runs, case)
        base = base_of(runs[0], case)
        base_ms = median(base) if base else None
        goal = {"goal": SERVING_GOAL_RATIO * base_ms} if base_ms else None
        rows.append({"case": case, "ref": goal, "ours": ours, "repeat": rep_ms, "floor": case.get("floor_ms")})
        cells = [case["name"], case.get("derived_from", "-"), seq_text(case["seq_lens"]), str(case["heads"]),
                 serving_features(case)]
        if "error" in case:
            out.append(error_row(cells + ["error: " + case["error"].replace("|", "/")], header))
            continue
        ratio = ours / base_ms if ours and base_ms else None
        met = None if ratio is None else ratio <= SERVING_GOAL_RATIO
        if met is not None:
            with_base += 1
            within += met
        cells += [fmt(ours), fmt(rep_ms), f"{fmt(case.get('min_ms'))} / {fmt(case.get('max_ms'))}"]
        if gpu:
            cells += [fmt(case.get("effective_tbps"), 2), fmt(case.get("floor_ms")), fmt(case.get("ratio_to_floor"), 2)]
        else:
            cells += [fmt_count(case.get("token_heads_per_s"))]
        oracle = case.get("oracle", {})
        cells += [fmt(base_ms), fmt(ratio, 2), "-" if met is None else ("yes" if met else "no"),
                  fmt_err(oracle.get("out_rel")), fmt_err(oracle.get("final_state_rel"))]
        out.append("| " + " | ".join(cells) + " |")
    out.append(f"\n{within} of {with_base} serving rows with their base case in the run within 10% of it.\n")
    return out


def cpu_report(runs, paths, plot_path):
    first = runs[0]
    commits = sorted({r["commit"] for r in runs})
    out = ["# FlashKDA CPU backend\n"]
    note = first.get("scale_note") or ("CPU backend on scaled-down shapes" if first.get("scaled_down")
                                       else "CPU backend on the shapes given")
    out.append(f"Generated by `scripts/bench_report.py` from `flashkda bench` JSON "
               f"({', '.join(os.path.basename(p) for p in paths)}); commit {', '.join(commits)}; "
               f"{first.get('cpu_threads', '?')} threads; {note}.{overrides_text(runs)}\n")
    out.append("A CPU run: no floor, bandwidth or peer columns (docs/benchmark.md's figures are for one H200 "
               "at the full shapes). Median of steady-clock timings of single forward calls; throughput in "
               "token-heads per second (tokens x heads / median). Errors: fp64 oracle on two heads of every "
               "sequence, bar 3e-3.\n")
    header = ("| case | seq_lens (run) | H | shape of the case | median ms | repeat ms | min / max ms "
              "| token-heads/s | err out | err state |")
    cases = [c for c in first["cases"] if not is_serving(c)]
    serving = [c for c in first["cases"] if is_serving(c)]
    if cases or not serving:
        out.append(header)
        out.append("|" + "---|" * (header.count("|") - 1))
    rows = []
    for case in cases:
        rep = repeat_of(runs, case)
        rep_ms = median(rep) if rep else None
        orig = case.get("original_seq_lens")
        orig_text = f"{seq_text(orig)} x {case.get('original_heads')}" if orig else "-"
        if is_decode(case):
            decode = case["decode"]
            orig_text += f", {decode.get('pool_dtype')} pool" + (", token states" if decode.get("token_states") else "")
        if "error" in case:
            out.append(error_row([case["name"], seq_text(case["seq_lens"]), str(case["heads"]), orig_text,
                                  "error: " + case["error"].replace("|", "/")], header))
            continue
        rows.append({"case": case, "ref": None, "ours": median(case), "repeat": rep_ms, "floor": None})
        oracle = case.get("oracle", {})
        out.append(f"| {case['name']} | {seq_text(case['seq_lens'])} | {case['heads']} | {orig_text} | "
                   f"{fmt(median(case))} | {fmt(rep_ms)} | {fmt(case.get('min_ms'))} / {fmt(case.get('max_ms'))} | "
                   f"{fmt_count(case.get('token_heads_per_s'))} | {fmt_err(oracle.get('out_rel'))} | "
                   f"{fmt_err(oracle.get('final_state_rel'))} |")
    target = first.get("cpu_target_token_heads_per_s")
    overall = first.get("token_heads_per_s_overall")
    line = f"\nOverall {fmt_count(overall)} token-heads/s"
    if any(is_decode(c) for c in first["cases"]):
        line = (f"\nOverall {fmt_count(overall)} token-heads/s over the prefill cases" if overall is not None
                else "\nNo prefill case ran") + " (the decode cases move a whole state per token-head)"
    if target:
        line += (f"; target >= {fmt_count(target)}: {'met' if first.get('cpu_target_met') else 'NOT met'}"
                 f" ({'by every case' if first.get('cpu_target_met_every_case') else 'not by every case'})")
    out.append(line + f". All outputs written and within the error bar: {all(r.get('all_pass') for r in runs)}.\n")
    if serving:
        out += serving_table(runs, serving, rows, gpu=False)
    if plot_path and plot_cpu(rows, runs, plot_path):
        out.append(f"![each case]({os.path.basename(plot_path)})\n")
    return out


def pyplot():
    """matplotlib.pyplot (headless), or None with a note on stderr when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("bench_report.py: matplotlib is not installed (pip install matplotlib): no plot written; "
              "the Markdown is complete without it", file=sys.stderr)
        return None


# The peers in the plot: (legend label, key of the reference figures, marker, colour).
PEERS = [
    ("FlashKDA (original CUDA)", "flashkda", "v", "#7f7f7f"),
    ("FlashKDA fork", "fork", "s", "#9467bd"),
    ("Triton (fla)", "triton", "D", "#2ca02c"),
    ("prefill path before the decode kernel", "before", "X", "#8c564b"),
]


def log_time_axis(ax):
    """A log-scale time axis labelled in plain numbers at 1, 2 and 5 of each decade."""
    from matplotlib import ticker
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def plot_gpu(rows, runs, path):
    """Writes the plot of a GPU run; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig_width = max(8, 1.05 * len(rows) + 3.5)
    fig, ax = plt.subplots(figsize=(fig_width, 5.5))
    labelled = set()

    def once(label):
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for x, row in enumerate(rows):
        ref = row["ref"] or {}
        ours, rep, floor = row["ours"], row["repeat"], row["floor"]
        # The gap between the measured floor and our median.
        if ours is not None and floor is not None:
            ax.plot([x + 0.12, x + 0.12], [floor, ours], color="#d62728", alpha=0.2, linewidth=7,
                    solid_capstyle="butt", zorder=1)
        # Horizontal ticks across the case: the floor, the fastest peer, done-when and goal.
        for value, label, color, style, width in (
                (floor, "floor (measured in the run)", "black", "-", 2.2),
                (ref.get("fastest"), "fastest peer", "#ff7f0e", "-", 1.6),
                (ref.get("done_when"), "done-when", "#1f77b4", "--", 1.4),
                (ref.get("goal"), "goal", "#1f77b4", ":", 1.6)):
            if value:
                ax.plot([x - 0.38, x + 0.38], [value, value], color=color, linestyle=style, linewidth=width,
                        label=once(label), zorder=2)
        # The peers (those with a figure) on the left half, ours (and the repeat) on the right.
        present = [(label, ref[key], marker, color) for label, key, marker, color in PEERS if ref.get(key)]
        for i, (label, value, marker, color) in enumerate(present):
            ax.scatter([x - 0.28 + 0.12 * i], [value], marker=marker, s=34, color=color, label=once(label), zorder=3)
        if ours is not None:
            ax.scatter([x + 0.12], [ours], marker="o", s=55, color="#d62728", label=once("ours (median)"),
                       zorder=4)
            text = f"{ours:.3f}" + (f"\n{ours / floor:.1f}x floor" if floor else "")
            ax.annotate(text, (x + 0.12, ours), textcoords="offset points", xytext=(0, 9), ha="center",
                        va="bottom", fontsize=7, color="#d62728")
        if rep is not None:
            ax.scatter([x + 0.26], [rep], marker="o", s=40, facecolors="none", edgecolors="#d62728",
                       label=once("ours (repeat)"), zorder=4)
    log_time_axis(ax)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['case']['name']}\n{seq_label(r['case'])}" for r in rows], fontsize=8)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel("time per forward call, ms (log scale)")
    ax.grid(axis="y", which="both", alpha=0.3)
    commits = ", ".join(sorted({r["commit"] for r in runs}))
    title = (f"FlashKDA bench on {runs[0].get('device') or 'the GPU'}, commit {commits}: "
             f"each case against its floor and the peers (docs/benchmark.md)")
    # Room above the highest point for its label; the title wrapped to a narrow figure (few cases).
    ax.margins(y=0.12)
    ax.set_title("\n".join(textwrap.wrap(title, width=int(8 * fig_width))), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print(f"bench_report.py: plot written to {path}", file=sys.stderr)
    return True


def plot_cpu(rows, runs, path):
    """Writes the plot of a CPU run; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(rows) + 3), 4.5))
    for x, row in enumerate(rows):
        ax.scatter([x], [row["ours"]], marker="o", s=60, color="#d62728", label="ours (median)" if x == 0 else None)
        if row["repeat"] is not None:
            ax.scatter([x + 0.15], [row["repeat"]], marker="o", s=60, facecolors="none", edgecolors="#d62728",
                       label="ours (repeat)" if x == 0 else None)
    log_time_axis(ax)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['case']['name']}\n{seq_label(r['case'])}" for r in rows], fontsize=8)
    ax.set_ylabel("time per forward call, ms (log scale)")
    ax.grid(axis="y", which="both", alpha=0.3)
    commits = ", ".join(sorted({r["commit"] for r in runs}))
    ax.set_title(f"FlashKDA CPU backend, commit {commits}: scaled-down shapes, no floor or peer figures",
                 fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print(f"bench_report.py: plot written to {path}", file=sys.stderr)
    return True


def seq_label(case):
    seq = case["seq_lens"]
    if len(seq) > 1 and len(set(seq)) == 1:
        text = f"{len(seq)}x{seq[0]}"
    elif len(seq) > 2:
        text = f"{len(seq)} seqs"
    else:
        text = ",".join(map(str, seq))
    pool = f"\n{case['decode'].get('pool_dtype')} pool" if is_decode(case) else ""
    return f"{text}, H{case['heads']}{pool}" + ("\n(error)" if "error" in case else "")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Markdown table (stdout) and optional PNG plot from `flashkda bench` JSON.")
    parser.add_argument("runs", nargs="+", metavar="RUN.json", help="a run, and optionally a repeat of it")
    parser.add_argument("--plot", metavar="PATH.png", help="also write a plot of each case (needs matplotlib)")
    args = parser.parse_args(argv)
    if len(args.runs) > 2:
        parser.error("give one run, or a run and its repeat")
    runs = load(args.runs)
    if runs[0].get("backend") == "cpu":
        out = cpu_report(runs, args.runs, args.plot)
    else:
        out = gpu_report(runs, args.runs, args.plot)
    print("\n".join(out))


if __name__ == "__main__":
    main()
