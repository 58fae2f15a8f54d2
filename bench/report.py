"""Print the Markdown tables of the README's Performance section from ``bench/results/*.json``.

    python bench/report.py

Reads whatever of ``averaging.json``, ``overhead.json``, ``convergence.json`` and
``multinode.json`` exists; it measures nothing itself.
"""

from __future__ import annotations

import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _load(name: str):
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f}"


def averaging(d) -> None:
    env = d["environment"]
    print(f"Measured {env['utc']}, load average {env['load_average_1_5_15']} on {env['host_cpus']} CPUs; "
          f"median of {d['reps']} rounds (slowest rank); peak extra memory: {d['memory_method']}.\n")
    print("| model | ranks | ours s | torch s | floor s | ours/floor (<= 1.2) | ours/torch (<= 0.7) | "
          "peak extra MB: ours | torch | target ours (bucket + largest tensor) | model MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        m, p = r["median_s"], r["peak_extra_bytes"]
        print(f"| {r['model']} ({r['tensors']} tensors) | {r['world_size']} | {m['ours']:.3f} | {m['torch']:.3f} | "
              f"{m['floor']:.3f} | {r['ratio_ours_floor']:.2f} | {r['ratio_ours_torch']:.2f} | {_mb(p['ours'])} | "
              f"{_mb(p['torch'])} | {_mb(r['ours_memory_target_bytes'])} | {_mb(r['model_bytes'])} |")
    print("\nFastest round of each contender instead of the median (less sensitive to other jobs): " + "; ".join(
        f"{r['model']}/{r['world_size']} ranks: ours/floor {r['min_ratio_ours_floor']:.2f}, ours/torch "
        f"{r['min_ratio_ours_torch']:.2f}" for r in d["rows"] if "min_ratio_ours_floor" in r) + ".")
    ab = [r for r in d["rows"] if "ratio_ours_raw_baseline_raw" in r]
    if ab:
        print(f"\nA/B against `average_tensors_` at {ab[0]['baseline_rev']} (before the changes for this benchmark), "
              "same processes, medians: now / before = " + "; ".join(
                  f"{r['model']}/{r['world_size']} ranks: **{r['ratio_ours_raw_baseline_raw']:.2f}** "
                  f"(before/floor {r['ratio_baseline_raw_floor']:.2f}, now/floor {r['ratio_ours_raw_floor']:.2f})"
                  for r in ab) + ".")
    for s in d["sharded"]:
        per = sorted(set(s["payload_bytes_per_round_by_rank"]))
        print(f"\nSharded mode ({s['model']}, {s['world_size']} ranks, {s['ranks_per_replica']} ranks per replica): "
              f"each rank all-reduces {', '.join(_mb(b) for b in per)} MB per round (from `metrics()`), "
              f"model {_mb(s['model_bytes'])} MB / {s['ranks_per_replica']} = {_mb(s['model_bytes'] / s['ranks_per_replica'])} MB; "
              f"ours {s['median_s']['ours']:.3f} s vs floor {s['median_s']['floor']:.3f} s on the same subgroup "
              f"(ours/floor {s['ratio_ours_floor']:.2f}).")


def overhead(d) -> None:
    env = d["environment"]
    print(f"Measured {env['utc']}, load average {env['load_average_1_5_15']}; median of {d['blocks']} blocks.\n")
    print("| model | inner | bare µs/step | wrapped µs/step | ratio (<= 1.02) | wrapper's own work µs/step | (bare + own) / bare |")
    print("|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        m = r["median_step_s"]
        print(f"| {r['model']} | {r['inner']} | {m['bare'] * 1e6:.1f} | {m['wrapped'] * 1e6:.1f} | "
              f"{r['ratio_wrapped_bare']:.3f} | {r['isolated_wrapper_us_per_step']:.2f} | {r['isolated_ratio']:.4f} |")


def convergence(d) -> None:
    a = d["args"]
    print(f"{a['steps']} steps, batch {a['batch']} per rank, SGD lr {a['lr']} momentum 0.9, MLP hidden {a['hidden']}; "
          "loss and accuracy of the mean of the 8 replicas after the last step.\n")
    print("| split | contender | rounds per level (asserted) | global rounds | final training loss | test accuracy % |")
    print("|---|---|---|---|---|---|")
    for r in d["rows"]:
        rpl = ", ".join(f"{k}: {v}" for k, v in r["rounds_per_level"].items())
        rpl = rpl.replace("grad_allreduce_every_step", "gradient all-reduce")
        print(f"| {r['split']} | {r['contender']} | {rpl} | {r['global_rounds']} | {r['final_train_loss']:.4f} | "
              f"{100 * r['final_test_accuracy']:.2f} |")
    for split, c in d["checks"].items():
        print(f"\n{split}: loss(local_4) <= loss(hier_2lvl) <= loss(local_32): **{c['loss_local4_le_hier_le_local32']}**; "
              f"accuracy(hier_2lvl) - accuracy(sync_dp) = **{c['hier_acc_minus_sync_points']:+.2f}** points; "
              f"global rounds {c['global_round_ratio_sync_over_hier']:.0f}x fewer.")


def multinode(d) -> None:
    runs = d["runs"]
    dd = runs["ddp"]
    env = d["environment"]
    print(f"Link {d['rate']} (measured {d['measured_link_mbit_s']:.0f} Mbit/s), model {dd['params'] / 1e6:.1f}M parameters "
          f"({_mb(dd['model_bytes'])} MB), {dd['steps']} steps, batch {dd['batch_per_rank']} per rank; measured "
          f"{env['utc']}, load average at start {env['load_average_at_start']}.\n")
    print("| mode | levels | s/step (mean) | s/step (median) | total s | final training loss | test accuracy % |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in runs.items():
        lv = "gradient all-reduce every step" if not r["levels"] else "`" + json.dumps(r["levels"]) + "`"
        print(f"| {mode} | {lv} | {r['seconds_per_step_mean']:.3f} | {r['seconds_per_step_median']:.3f} | "
              f"{r['seconds_total']:.1f} | {r['final_train_loss_avg_model']:.4f} | {100 * r['final_test_accuracy_avg_model']:.2f} |")
    print(f"\nWall-clock per step, DDP / hierarchical: **{d['speedup_ddp_over_hier_per_step']:.2f}x**.")


def main() -> None:
    for name, fn in (("averaging.json", averaging), ("overhead.json", overhead),
                     ("convergence.json", convergence), ("multinode.json", multinode)):
        d = _load(name)
        print(f"\n<!-- {name} -->")
        if d is None:
            print(f"(no bench/results/{name})", file=sys.stderr)
            continue
        fn(d)


if __name__ == "__main__":
    main()
