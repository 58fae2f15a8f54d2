"""Render the Markdown tables of the performance page from ``bench/results/*.json``.

    python bench/report.py          # print every table to stdout
    python bench/report.py --docs   # write them to docs/snippets/bench_<name>.md for the docs site,
                                    # and copy bench/results/convergence*.png to docs/img/

Reads whatever of ``averaging.json``, ``codecs.json``, ``overhead.json``, ``convergence.json``,
``convergence_chars.json``, ``convergence_chars_long.json``, ``convergence_chars_delay.json`` and
``convergence_chars_compress.json`` (the sweeps of issues 24 and 25), ``multinode.json``,
``multinode_delay.json``, ``multinode_compress.json`` and the quiet-machine reruns ``multinode_quiet.json``,
``multinode_delay_tau15.json``, ``multinode_delay_node.json``, ``multinode_delay_b64.json`` and
``multinode_delay_b64_repeat.json``, ``multinode_node_int8_delay.json`` exists; it measures nothing itself: the
targets' ratios are computed here from the recorded runs, met or missed. ``docs/performance.md`` includes the ``--docs`` files (``--8<--``
snippets), so rerun it after a benchmark rewrites its results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
DOCS_SNIPPETS = os.path.join(ROOT, "docs", "snippets")
DOCS_IMAGES = os.path.join(ROOT, "docs", "img")
PLOTS = ("convergence.png", "convergence_chars.png", "convergence_chars_long.png", "convergence_chars_delay.png",
         "convergence_chars_compress.png", "convergence_chars_ef.png", "convergence_chars_long_delay.png",
         "convergence_chars_long_topk.png")
"""Plots under ``bench/results/`` that the performance page shows, copied by ``--docs``."""


def _load(name: str):
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _bench_module(name: str):
    """``bench/NAME.py`` as a module (the benchmark's own functions that compute its targets)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _writer(out: list[str]) -> Callable[..., None]:
    """A ``print`` that appends its line to ``out``."""

    def w(text: str = "") -> None:
        out.append(text + "\n")

    return w


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f}"


def _measured(env) -> str:
    """When and under which load a timing benchmark ran, the start of its tables' first line."""
    return f"Measured {env['utc']}, load average {env['load_average_1_5_15']} on {env['host_cpus']} CPUs; "


def averaging(d) -> str:
    out: list[str] = []
    w = _writer(out)
    env = d["environment"]
    w(f"{_measured(env)}median of {d['reps']} rounds (slowest rank); peak extra memory: {d['memory_method']}.\n")
    guarded = all("ours_raw" in r["median_s"] and "guard_fraction_cpu_paired_median" in r for r in d["rows"])
    if guarded:
        w("*ours* is the default round (`nonfinite=\"raise\"`: agreement, non-finite guard, averaging), *raw* "
          "`average_tensors_` alone.\n\n")
        w("| model | ranks | ours s | raw s | torch s | floor s | ours/raw (<= 1.03) | ours/floor (<= 1.3) | "
          "ours/torch (<= 0.7) | peak extra MB: ours | torch | target ours (bucket + largest tensor) | model MB |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        w("| model | ranks | ours s | torch s | floor s | ours/floor (<= 1.2) | ours/torch (<= 0.7) | "
          "peak extra MB: ours | torch | target ours (bucket + largest tensor) | model MB |")
        w("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        m, p = r["median_s"], r["peak_extra_bytes"]
        raw = f"{m['ours_raw']:.3f} | " if guarded else ""
        vs_raw = f"{m['ours'] / m['ours_raw']:.2f} | " if guarded else ""
        w(f"| {r['model']} ({r['tensors']} tensors) | {r['world_size']} | {m['ours']:.3f} | {raw}{m['torch']:.3f} | "
          f"{m['floor']:.3f} | {vs_raw}{r['ratio_ours_floor']:.2f} | {r['ratio_ours_torch']:.2f} | {_mb(p['ours'])} | "
          f"{_mb(p['torch'])} | {_mb(r['ours_memory_target_bytes'])} | {_mb(r['model_bytes'])} |")
    if guarded:
        w("\nThe non-finite guard, paired per round against `nonfinite=\"ignore\"` (wall time / CPU time of all ranks): "
          + "; ".join(
              f"{r['model']}/{r['world_size']} ranks: fused {100 * r['guard_fraction_paired_median']:+.1f}% / "
              f"{100 * r['guard_fraction_cpu_paired_median']:+.1f}%, as a separate read "
              f"{100 * r['read_guard_fraction_paired_median']:+.1f}% / {100 * r['read_guard_fraction_cpu_paired_median']:+.1f}%"
              for r in d["rows"]) + ".")
        w("\nPaths, `average_tensors_` coalesced / pipelined (the CPU default): " + "; ".join(
            f"{r['model']}/{r['world_size']} ranks: {r['median_s']['ours_coalesced'] / r['median_s']['ours_raw']:.2f}"
            for r in d["rows"]) + ".")
    w("\nFastest round of each contender instead of the median (less sensitive to other jobs): " + "; ".join(
        f"{r['model']}/{r['world_size']} ranks: ours/floor {r['min_ratio_ours_floor']:.2f}, ours/torch "
        f"{r['min_ratio_ours_torch']:.2f}" for r in d["rows"] if "min_ratio_ours_floor" in r) + ".")
    ab = [r for r in d["rows"] if "ratio_ours_raw_baseline_raw" in r]
    if ab:
        w(f"\nA/B against `average_tensors_` at {ab[0]['baseline_rev']} (before the changes for this benchmark), "
          "same processes, medians: now / before = " + "; ".join(
              f"{r['model']}/{r['world_size']} ranks: **{r['ratio_ours_raw_baseline_raw']:.2f}** "
              f"(before/floor {r['ratio_baseline_raw_floor']:.2f}, now/floor {r['ratio_ours_raw_floor']:.2f})"
              for r in ab) + ".")
    for s in d["sharded"]:
        per = sorted(set(s["payload_bytes_per_round_by_rank"]))
        w(f"\nSharded mode ({s['model']}, {s['world_size']} ranks, {s['ranks_per_replica']} ranks per replica): "
          f"each rank all-reduces {', '.join(_mb(b) for b in per)} MB per round (from `metrics()`), "
          f"model {_mb(s['model_bytes'])} MB / {s['ranks_per_replica']} = {_mb(s['model_bytes'] / s['ranks_per_replica'])} MB; "
          f"ours {s['median_s']['ours']:.3f} s vs floor {s['median_s']['floor']:.3f} s on the same subgroup "
          f"(ours/floor {s['ratio_ours_floor']:.2f}).")
    return "".join(out)


def overhead(d) -> str:
    out: list[str] = []
    w = _writer(out)
    env = d["environment"]
    w(f"Measured {env['utc']}, load average {env['load_average_1_5_15']}; median of {d['blocks']} blocks.\n")
    w("| model | inner | bare µs/step | wrapped µs/step | ratio (<= 1.02) | wrapper's own work µs/step | (bare + own) / bare |")
    w("|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        m = r["median_step_s"]
        w(f"| {r['model']} | {r['inner']} | {m['bare'] * 1e6:.1f} | {m['wrapped'] * 1e6:.1f} | "
          f"{r['ratio_wrapped_bare']:.3f} | {r['isolated_wrapper_us_per_step']:.2f} | {r['isolated_ratio']:.4f} |")
    return "".join(out)


def codecs(d) -> str:
    """``bench/codecs.py``: each codec's encode and decode against the all-reduce floor, per size and world size."""
    out: list[str] = []
    w = _writer(out)
    env = d["environment"]
    w(f"{_measured(env)}median of {d['reps']} repetitions (slowest rank); one flat float32 tensor per rank.\n")
    w("| codec | elements | ranks | floor s | encode s | decode s (all payloads) | all-gather s | payload / fp32 | "
      "(encode + decode) / floor | (encode + all-gather + decode) / floor |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        m = r["median_s"]
        w(f"| `{json.dumps(r['spec'])}` | {r['numel'] / 1e6:.0f}M | {r['world_size']} | {m['floor']:.3f} | "
          f"{m['encode']:.3f} | {m['decode']:.3f} | {m['exchange']:.3f} | {r['payload_over_fp32']:.4f} | "
          f"{r['codec_over_floor']:.2f} | {r['compressed_round_over_floor']:.2f} |")
    return "".join(out)


def convergence(d) -> str:
    out: list[str] = []
    w = _writer(out)
    a = d["args"]
    w(f"{a['steps']} steps, batch {a['batch']} per rank, SGD lr {a['lr']} momentum 0.9, MLP hidden {a['hidden']}; "
      "loss and accuracy of the mean of the 8 replicas after the last step.\n")
    w("| split | contender | rounds per level (asserted) | global rounds | final training loss | test accuracy % |")
    w("|---|---|---|---|---|---|")
    for r in d["rows"]:
        rpl = ", ".join(f"{k}: {v}" for k, v in r["rounds_per_level"].items())
        rpl = rpl.replace("grad_allreduce_every_step", "gradient all-reduce")
        w(f"| {r['split']} | {r['contender']} | {rpl} | {r['global_rounds']} | {r['final_train_loss']:.4f} | "
          f"{100 * r['final_test_accuracy']:.2f} |")
    for split, c in d["checks"].items():
        w(f"\n{split}: loss(local_4) <= loss(hier_2lvl) <= loss(local_32): **{c['loss_local4_le_hier_le_local32']}**; "
          f"accuracy(hier_2lvl) - accuracy(sync_dp) = **{c['hier_acc_minus_sync_points']:+.2f}** points; "
          f"global rounds {c['global_round_ratio_sync_over_hier']:.0f}x fewer.")
    return "".join(out)


def convergence_chars(d) -> str:
    out: list[str] = []
    w = _writer(out)
    st, env, c = d["settings"], d["environment"], d["checks"]
    corpus = st["corpus"]
    w(f"{st['steps']} steps, batch {st['batch']} windows of {st['context']} bytes per rank, transformer width "
      f"{st['d_model']}, AdamW inner; data: Python {corpus['python']}'s stdlib, {corpus['files']} files, "
      f"{corpus['bytes']:,} bytes; written {env['utc']}. Validation loss (nats per byte) of the model after the "
      "last step, which is a top-level round; seconds: training only, 8 ranks sharing 2 cores with other jobs.\n")
    w("| contender | inner lr | outer lr / momentum | outer on periods | rounds per level (asserted) | global rounds "
      "| validation loss | s |")
    w("|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        rpl = ", ".join(f"{k}: {v}" for k, v in r["rounds_per_level"].items())
        rpl = rpl.replace("grad_allreduce_every_step", "gradient all-reduce")
        outer = f"{r['outer_lr']:g} / {r['outer_momentum']:g}" if r["outer_lr"] else "-"
        periods = ", ".join(map(str, r["outer_periods"])) or "-"
        w(f"| {r['contender']} | {r['lr']:g} | {outer} | {periods} | {rpl} | {r['global_rounds']} | "
          f"{r['final_val_loss']:.4f} | {r['seconds']:.0f} |")
    if "hier_outer_top_over_sync_dp" in c:
        w(f"\nBest of each sweep: hier_outer_top / sync_dp validation loss = **{c['hier_outer_top_over_sync_dp']:.4f}** "
          f"(within 3%: **{c['hier_outer_top_within_3pct_of_sync_dp']}**) with "
          f"{c['global_rounds_sync_dp_over_hier']:.1f}x fewer global rounds; below plain hier_2lvl: "
          f"**{c.get('hier_outer_top_below_hier_2lvl')}**.")
    return "".join(out)


def convergence_sweep(d) -> str:
    """A sweep of top-level settings on the chars LM (``--sweep delay`` / ``--sweep compress``): per row the final
    validation loss and the top level's bytes against the row without the settings, and the issues' targets,
    computed from the rows by ``bench/convergence.py``'s ``_sweep_checks``, met or missed."""
    out: list[str] = []
    w = _writer(out)
    st = d["settings"]
    corpus = st["corpus"]
    w(f"{st['steps']} steps, batch {st['batch']} windows of {st['context']} bytes per rank, transformer width "
      f"{st['d_model']}, AdamW inner; data: Python {corpus['python']}'s stdlib, {corpus['files']} files; evaluated: "
      f"{st.get('eval', 'the model of rank 0')}, after the last step. Seconds: training only, 8 ranks sharing 2 "
      "cores with other jobs; started and load average: at the start of the invocation that ran the row.\n")
    sweep = _bench_module("convergence")._sweep_checks(d["rows"])  # computed from the rows, with today's targets
    ratios = {(r["contender"], r["lr"], r["outer_lr"], r["outer_momentum"], json.dumps(r["top"], sort_keys=True)): r
              for r in sweep["rows"]}  # fmt: skip
    w("| contender | inner lr | outer lr / momentum | top-level settings | rounds per level (`metrics()`) | "
      "validation loss | / baseline | / baseline, last 4 evaluations | the round in flight applied at the end: "
      "validation loss / baseline | top-level payload MB per rank | / baseline | top-level MB sent per rank | "
      "/ baseline | `compression_ratio` | payload / fp32, per compressed round | started (UTC) | load average | s | "
      "hieravg_optim |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        top = r.get("top", {})
        key = (r["contender"], r["lr"], r["outer_lr"], r["outer_momentum"], json.dumps(top, sort_keys=True))
        ratio = ratios.get(key)
        loss_ratio = f"{ratio['loss_over_baseline']:.4f}" if ratio else "-"
        applied = (f"{r['val_loss_in_flight_applied']:.4f} / {ratio['applied_loss_over_baseline']:.4f}"
                   if ratio and "applied_loss_over_baseline" in ratio else "-")
        last4 = f"{ratio['loss_over_baseline_last4']:.4f}" if ratio and ratio["loss_over_baseline_last4"] else "-"
        bytes_ratio = f"{ratio['bytes_over_baseline']:.4f}" if ratio else "-"
        payload_ratio = f"{ratio['payload_over_baseline']:.4f}" if ratio and ratio["payload_over_baseline"] else "-"
        payload = r.get("top_level_metrics", {}).get("payload_bytes")
        cr = ratio.get("compression_ratio") if ratio else None
        per_round = ratio.get("payload_over_fp32_compressed_rounds") if ratio else None
        codec = f"{cr:.4f} | {per_round:.4f}" if cr is not None and per_round is not None else "- | -"
        top_payload = _mb(payload) if payload is not None else "-"
        rpl = ", ".join(f"{k}: {v}" for k, v in r["rounds_per_level"].items())
        outer = f"{r['outer_lr']:g} / {r['outer_momentum']:g}" if r["outer_lr"] else "-"
        sent = r.get("bytes_sent_per_level", {})
        top_sent = _mb(sent[str(max(int(p) for p in sent))]) if sent else "-"
        label = "`" + json.dumps(top) + "`" if top else "- (baseline)"
        load = r.get("environment_load_average", ["?"])[0]
        w(f"| {r['contender']} | {r['lr']:g} | {outer} | {label} | {rpl} | {r['final_val_loss']:.4f} | {loss_ratio} | {last4} | {applied} | "
          f"{top_payload} | {payload_ratio} | {top_sent} | {bytes_ratio} | {codec} | "
          f"{r['utc_start'].replace('T', ' ').rstrip('Z') if 'utc_start' in r else '-'} | {load} | {r['seconds']:.0f} | "
          f"{(r.get('hieravg_optim') or {}).get('revision') or '-'} |")
    if sweep["targets"]:
        w("\n| feature | row | measure | value | target | |")
        w("|---|---|---|---|---|---|")
        for t in sweep["targets"]:
            w(f"| {FEATURES[t['issue']]} | {t['label']} | {t['what']} | {t['value']:.4f} | {t['target']} | "
              f"{'met' if t['met'] else '**missed**'} |")
    return "".join(out)


def multinode(d) -> str:
    out: list[str] = []
    w = _writer(out)
    runs = d["runs"]
    dd = runs["ddp"]
    env = d["environment"]
    w(f"Link {d['rate']} (measured {d['measured_link_mbit_s']:.0f} Mbit/s), model {dd['params'] / 1e6:.1f}M parameters "
      f"({_mb(dd['model_bytes'])} MB), {dd['steps']} steps, batch {dd['batch_per_rank']} per rank; measured "
      f"{env['utc']}, load average at start {env['load_average_at_start']}.\n")
    w("| mode | levels | s/step (mean) | s/step (median) | total s | final training loss | test accuracy % |")
    w("|---|---|---|---|---|---|---|")
    for mode, r in runs.items():
        lv = "gradient all-reduce every step" if not r["levels"] else "`" + json.dumps(r["levels"]) + "`"
        w(f"| {mode} | {lv} | {r['seconds_per_step_mean']:.3f} | {r['seconds_per_step_median']:.3f} | "
          f"{r['seconds_total']:.1f} | {r['final_train_loss_avg_model']:.4f} | {100 * r['final_test_accuracy_avg_model']:.2f} |")
    w(f"\nWall-clock per step, DDP / hierarchical: **{d['speedup_ddp_over_hier_per_step']:.2f}x**.")
    return "".join(out)


FEATURES = {24: "delayed rounds, fragments", 25: "compressed rounds"}
"""The feature each target belongs to (the number of the issue that asks for it, in the results files)."""

MULTINODE_TARGETS = {
    # mode -> (baseline mode in the same run, issue)
    "hier_delay": ("hier", 24), "hier_frag": ("hier", 24), "hier_delay_frag": ("hier", 24),
    "hier_node_delay": ("hier_node", 24), "hier_node_delay_frag": ("hier_node", 24),
    "hier_node_int8_delay": ("hier_node_int8", 24),
    "hier_node_int8": ("hier_node", 25), "hier_node_topk": ("hier_node", 25),
}
"""The feature modes of ``bench/multinode.sh`` and the mode of the same run each one is compared with."""


def cross_node_round_s(r) -> float | None:
    """Seconds per cross-node round from the run's ``metrics()`` (the top level's ``seconds`` / ``rounds``)."""
    metrics = r.get("metrics")
    if not metrics:
        return None
    top = metrics[max(metrics, key=int)]
    return top["seconds"] / top["rounds"] if top["rounds"] else None


def compressed_round_s(r) -> float | None:
    """Seconds of a cross-node round after the first, from the step times: at each count ``c >= period`` with
    ``c % period == 0`` (a compressed level's first round, at count 0, is uncompressed: its anchors are taken
    then), the step's time above the median step, averaged over those counts."""
    if not r.get("levels"):
        return None
    period = max(int(p) for p in r["levels"])
    steps = r["seconds_per_step"]
    extra = [steps[c] - r["seconds_per_step_median"] for c in range(period, len(steps), period)]
    return sum(extra) / len(extra) if extra else None


def multinode_checks(runs) -> list[dict]:
    """The issue-24 and issue-25 targets of each feature mode against its baseline in the same run, computed.

    Issue 24 (delay, fragments, against ``hier``; ``hier_node_delay*`` against ``hier_node``,
    ``hier_node_int8_delay`` against ``hier_node_int8``): the slowest step at most 1.5x the median step; the mean
    seconds per step at least 1.25x better; the final training loss within 1%. Issue 25 (compressed, against
    ``hier_node``): a cross-node round at least 3x shorter (:func:`compressed_round_s`: the rounds after the
    first, which is uncompressed); the final training loss within 1%.
    """
    checks = []
    for mode, (base_mode, issue) in MULTINODE_TARGETS.items():
        if mode not in runs or base_mode not in runs:
            continue
        r, base = runs[mode], runs[base_mode]
        loss_ratio = r["final_train_loss_avg_model"] / base["final_train_loss_avg_model"]

        def check(what, value, target, met):
            checks.append({"issue": issue, "mode": mode, "baseline": base_mode, "what": what, "value": value,
                           "target": target, "met": bool(met)})  # fmt: skip

        if issue == 24:
            slow = max(r["seconds_per_step"]) / r["seconds_per_step_median"]
            check("slowest step / median step", slow, "<= 1.5", slow <= 1.5)
            speed = base["seconds_per_step_mean"] / r["seconds_per_step_mean"]
            check(f"mean s/step, {base_mode} / {mode}", speed, ">= 1.25", speed >= 1.25)
        else:
            base_s, s = compressed_round_s(base), compressed_round_s(r)
            ratio = base_s / s if base_s and s and s > 0 else float("nan")
            check(f"cross-node round after the first (its step above the median step) s, {base_mode} / {mode}",
                  ratio, ">= 3", ratio >= 3)
        check(f"final loss, {mode} / {base_mode}", loss_ratio, "within 1%", abs(loss_ratio - 1) <= 0.01)
    return checks


def multinode_modes(d) -> str:
    """The runs of ``bench/multinode.sh`` with feature modes: per mode the step times, the cross-node round, the
    final loss, and the targets of issues 24 and 25 (:func:`multinode_checks`) with their ratios, met or missed."""
    out: list[str] = []
    w = _writer(out)
    runs, env = d["runs"], d["environment"]
    first = next(iter(runs.values()))
    w(f"Link {d['rate']} (measured {d['measured_link_mbit_s']:.0f} Mbit/s), model {first['params'] / 1e6:.1f}M "
      f"parameters ({_mb(first['model_bytes'])} MB), {first['steps']} steps, batch {first['batch_per_rank']} per rank; "
      f"measured {env['utc']} (end), load average at start {env['load_average_at_start']}.\n")
    w("| mode | levels | cross-node settings | s/step mean | median | slowest | slowest / median | "
      "s in a cross-node round (`metrics()`: seconds / rounds) | steps at the cross-node counts, s | "
      "MB sent per rank, cross-node level | final training loss | test accuracy % |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in runs.items():
        lv = "gradient all-reduce every step" if not r["levels"] else "`" + json.dumps(r["levels"]) + "`"
        period = max(int(p) for p in r["levels"]) if r["levels"] else None
        at_rounds = (", ".join(f"{c}: {r['seconds_per_step'][c]:.2f}" for c in range(0, len(r["seconds_per_step"]), period))
                     if period else "-")  # fmt: skip
        settings = dict(r.get("cross_node_settings") or {})
        if r.get("ranks_per_node_setting"):
            settings = {"ranks_per_node": r["ranks_per_node_setting"], **settings}
        st = "`" + json.dumps(settings) + "`" if settings else "-"
        steps = r["seconds_per_step"]
        round_s = cross_node_round_s(r)
        metrics = r.get("metrics") or {}
        sent = _mb(metrics[max(metrics, key=int)]["bytes_sent"]) if metrics else "-"
        w(f"| {mode} | {lv} | {st} | {r['seconds_per_step_mean']:.3f} | {r['seconds_per_step_median']:.3f} | "
          f"{max(steps):.3f} | {max(steps) / r['seconds_per_step_median']:.2f} | "
          f"{'-' if round_s is None else f'{round_s:.2f}'} | {at_rounds} | {sent} | {r['final_train_loss_avg_model']:.4f} | "
          f"{100 * r['final_test_accuracy_avg_model']:.2f} |")
    checks = multinode_checks(runs)
    if checks:
        w("\n| feature | mode | against | measure | value | target | |")
        w("|---|---|---|---|---|---|---|")
        for c in checks:
            w(f"| {FEATURES[c['issue']]} | {c['mode']} | {c['baseline']} | {c['what']} | {c['value']:.3f} | {c['target']} | "
              f"{'met' if c['met'] else '**missed**'} |")
    return "".join(out)


SECTIONS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("averaging", averaging), ("codecs", codecs), ("overhead", overhead), ("convergence", convergence),
    ("convergence_chars", convergence_chars), ("convergence_chars_long", convergence_chars),
    ("convergence_chars_delay", convergence_sweep), ("convergence_chars_compress", convergence_sweep),
    ("convergence_chars_ef", convergence_sweep), ("convergence_chars_long_delay", convergence_sweep),
    ("convergence_chars_long_topk", convergence_sweep), ("convergence_chars_delay_seed1", convergence_sweep),
    ("convergence_chars_delay_seed2", convergence_sweep),
    ("multinode", multinode), ("multinode_delay", multinode_modes), ("multinode_compress", multinode_modes),
    ("multinode_quiet", multinode_modes), ("multinode_delay_tau15", multinode_modes),
    ("multinode_delay_node", multinode_modes), ("multinode_delay_b64", multinode_modes),
    ("multinode_delay_b64_repeat", multinode_modes), ("multinode_node_int8_delay", multinode_modes),
)


def write_docs(snippets: str = DOCS_SNIPPETS, images: str = DOCS_IMAGES) -> list[str]:
    """Write ``bench_<name>.md`` for each result into ``snippets`` and copy the plots into ``images``.

    Returns:
        The paths written. A missing result writes a one-line note instead of its tables,
        so the page still builds.
    """
    os.makedirs(snippets, exist_ok=True)
    os.makedirs(images, exist_ok=True)
    written = []
    for name, fn in SECTIONS:
        d = _load(f"{name}.json")
        text = fn(d) if d is not None else f"(no `bench/results/{name}.json`: run the benchmark to fill this in)\n"
        path = os.path.join(snippets, f"bench_{name}.md")
        with open(path, "w") as f:
            f.write(text)
        written.append(path)
    for plot in PLOTS:
        src = os.path.join(RESULTS, plot)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(images, plot))
            written.append(os.path.join(images, plot))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", action="store_true",
                        help="write docs/snippets/bench_<name>.md and docs/img/ instead of printing")  # fmt: skip
    args = parser.parse_args(argv)
    if args.docs:
        for path in write_docs():
            print(f"wrote {os.path.relpath(path, ROOT)}")
        return
    for name, fn in SECTIONS:
        d = _load(f"{name}.json")
        print(f"\n<!-- {name}.json -->")
        if d is None:
            print(f"(no bench/results/{name}.json)", file=sys.stderr)
            continue
        print(fn(d), end="")


if __name__ == "__main__":
    main()
