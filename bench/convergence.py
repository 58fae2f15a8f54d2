"""Convergence of hierarchical averaging against synchronous data parallelism, local SGD and DiLoCo.

Run (a few minutes on 2 CPU cores)::

    OMP_NUM_THREADS=1 python bench/convergence.py                # digits (below)
    OMP_NUM_THREADS=1 python bench/convergence.py --task chars   # the character-level LM (after the digits)

Data: scikit-learn's handwritten digits (``examples/digits_common.py``), 8 ranks, split
two ways: IID (a seeded shuffle dealt round-robin) and non-IID by label (the training set
sorted by label and cut into 8 blocks: each rank sees one or two classes).

Contenders (one spawn of 8 gloo ranks runs them all, one after the other, with the same
initial weights, the same per-rank batches and the same inner optimizer, SGD with momentum):

* ``sync_dp``: synchronous data parallelism, ``DistributedDataParallel`` (gradient all-reduce every step);
* ``local_4`` / ``local_32``: local SGD, all 8 ranks average every 4 / 32 steps (``{4: 8}``, ``{32: 8}``);
* ``hier_2lvl``: ``{4: 4, 32: 8}``: groups of 4 every 4 steps, all 8 every 32 steps;
* ``hier_3lvl``: ``{2: 2, 4: 4, 32: 8}``.

Recorded: averaging rounds per level from ``metrics()`` (asserted equal to
``rounds_per_level``), and every ``--eval-every`` steps the *averaged* model (the mean of
the 8 replicas, computed on a copy) evaluated on the whole training set (loss) and the
test set (loss, accuracy). The final row is after the last step, without an extra
averaging round. Written to ``bench/results/convergence.{json,csv,png}``.

``--task chars``: a byte-level transformer on the Python standard library's own source files
(``examples/chars_common.py``), 8 ranks, non-IID by file (each rank trains on its own files; every
tenth file is held out for validation), AdamW as the inner optimizer (the same lr everywhere).
Contenders (one spawn of 8 ranks per invocation runs the selected ones one after the other):

* ``sync_dp``: ``DistributedDataParallel``, a gradient all-reduce every step;
* ``local_32``: ``{32: 8}``, plain averaging of all ranks every 32 steps;
* ``hier_2lvl``: ``{4: 4, 32: 8}``, plain averaging;
* ``diloco_1lvl``: ``{32: 8}`` with an outer Nesterov step (one-level DiLoCo, arXiv 2311.08105);
* ``hier_outer_top``: ``{4: 4, 32: 8}``, outer Nesterov on the top level only;
* ``hier_outer_both``: ``{4: 4, 32: 8}``, outer Nesterov on both levels (HALoS style, arXiv 2506.04531).

The outer contenders run once per ``--outer-lr`` value (momentum ``--outer-momentum``). The default
513 steps are counts 0..512: the top level averages at counts 0, 32, ..., 512 (17 rounds, one every
32 steps, the last one ending the run), synchronous DP all-reduces gradients 513 times. After each
top-level round (every replica then holds the same model) and at the same steps for DP, the
validation loss (next-byte cross-entropy, nats) is measured on 256 fixed windows of the held-out
files. ``--merge [NAME ...]`` keeps the rows of earlier runs of the same settings that this run does
not redo, so a sweep can be run piecewise (``--contenders none --merge A B`` only merges). Written to ``bench/results/convergence_chars.{json,png}``.

Settings of the top level (issues 24 and 25): ``--top JSON [JSON ...]`` runs every averaging contender once
per JSON object of ``AveragingConfig`` keywords, each value put on the top level only (``{"delay_steps": 8}``
becomes ``delay_steps={32: 8}``; ``{}`` is the contender as it is); ``--sweep delay`` and ``--sweep compress``
name the issues' sweeps (:data:`SWEEPS`), ``--only I,J`` runs some of a sweep's entries (0-based; the rest come
from ``--merge``). ``--eval-mean`` evaluates the mean of the 8 replicas (on a copy, over its own process group)
instead of rank 0's model, at the same counts: with a delayed round or fragments the replicas differ after a
top-level round's count. The sweeps' tables (:func:`_sweep_checks`) give each row's final validation loss and
top-level bytes sent against the ``{}`` row of the same contender and lrs, and the issues' targets, met or missed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from _common import RESULTS_DIR, environment, on_level, spawn, write_json  # noqa: E402

CONTENDERS = {
    "sync_dp": None,
    "local_4": {4: 8},
    "local_32": {32: 8},
    "hier_2lvl": {4: 4, 32: 8},
    "hier_3lvl": {2: 2, 4: 4, 32: 8},
}


def _count_rounds(row, opt, levels, steps, name, strict=True):
    """Put a run's global rounds and rounds per level into ``row``, checked against ``rounds_per_level``.

    Synchronous DP (``levels`` None) all-reduces the gradients over all ranks once per step. Returns
    the wrapper's ``metrics()``, or None for DP. ``strict=False`` (delayed rounds, fragments: ``metrics()``
    then counts what the feature counts, e.g. rounds applied by the end) records the counts unchecked.
    """
    from hieravg_optim.schedule import AveragingLevel, rounds_per_level

    if levels is None:
        row["global_rounds"] = steps
        row["rounds_per_level"] = {"grad_allreduce_every_step": steps}
        return None
    metrics = opt.metrics()
    expected = rounds_per_level(0, steps, [AveragingLevel(p, g) for p, g in levels.items()], 0)
    got = [metrics[p]["rounds"] for p in levels]
    assert got == expected or not strict, f"{name}: rounds per level {got} != rounds_per_level {expected}"
    row["rounds_per_level"] = {str(p): metrics[p]["rounds"] for p in levels}
    row["global_rounds"] = metrics[max(levels)]["rounds"]
    return metrics


def _averaged_eval(model, shard, world_size, torch, dist):
    """Loss on the whole training set and test loss/accuracy of the mean of the replicas (no rank changes)."""
    import copy

    avg = copy.deepcopy(model)
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in avg.parameters()])
        dist.all_reduce(flat)
        flat /= world_size
        offset = 0
        for p in avg.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        logits = avg(shard.x_train)
        sums = torch.tensor(
            [torch.nn.functional.cross_entropy(logits, shard.y_train, reduction="sum").item(), len(shard.y_train)],
            dtype=torch.float64,
        )
        dist.all_reduce(sums)
        test_logits = avg(shard.x_test)
        test_loss = torch.nn.functional.cross_entropy(test_logits, shard.y_test).item()
        test_acc = (test_logits.argmax(1) == shard.y_test).float().mean().item()
    return float(sums[0] / sums[1]), test_loss, test_acc


def _rank(rank: int, world_size: int, steps: int, batch: int, lr: float, hidden: int, eval_every: int):
    import time

    import torch
    import torch.distributed as dist
    from digits_common import batches, build_mlp, load_digits_shard

    from hieravg_optim import HierarchicalAveragingOptimizer

    out = []
    for split in ("iid", "non_iid"):
        shard = load_digits_shard(rank, world_size, non_iid=(split == "non_iid"))
        for name, levels in CONTENDERS.items():
            model = build_mlp(hidden=hidden, seed=0)
            inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            if levels is None:
                net = torch.nn.parallel.DistributedDataParallel(model)
                opt = inner
            else:
                net = model
                opt = HierarchicalAveragingOptimizer(inner, levels)
            curve = []
            step = 0
            epoch = 0
            dist.barrier()
            t0 = time.perf_counter()
            while step < steps:
                for x, y in batches(shard.x_train, shard.y_train, batch, epoch=epoch, seed=rank):
                    if step % eval_every == 0:
                        curve.append((step, *_averaged_eval(model, shard, world_size, torch, dist)))
                    opt.zero_grad()
                    loss = torch.nn.functional.cross_entropy(net(x), y)
                    loss.backward()
                    opt.step()
                    step += 1
                    if step == steps:
                        break
                epoch += 1
            seconds = time.perf_counter() - t0
            curve.append((step, *_averaged_eval(model, shard, world_size, torch, dist)))
            row = {"split": split, "contender": name, "levels": levels, "curve": curve, "seconds": seconds}
            metrics = _count_rounds(row, opt, levels, steps, name)
            if metrics is not None:
                row["bytes_sent_per_level"] = {str(p): metrics[p]["bytes_sent"] for p in levels}
            out.append(row)
            if levels is None:
                del net
    return out


TOPK_1PCT = {"type": "topk", "density": 0.01, "values": "int8"}
SWEEPS: dict[str, list[dict]] = {
    # issue 24: tau in {0, 1, 4, 8}, with the eager correction (default) and the naive delay; fragments in {1, 4}
    # (tau below the fragment spacing 32 / 4 = 8).
    "delay": [
        {},
        {"delay_steps": 8},
        {"delay_steps": 8, "delay_correction": "none"},
        {"fragments": 4},
        {"delay_steps": 4},
        {"delay_steps": 4, "delay_correction": "none"},
        {"delay_steps": 1},
        {"delay_steps": 1, "delay_correction": "none"},
        {"fragments": 4, "delay_steps": 4},
    ],
    # issue 25: int8 and top-k 1% with int8 values, then the density and ef_decay sweep; ef_decay 0 keeps no
    # error-feedback residual.
    "compress": [
        {},
        {"compress": "int8"},
        {"compress": TOPK_1PCT},
        {"compress": TOPK_1PCT, "ef_decay": 0.0},
        {"compress": {**TOPK_1PCT, "density": 0.1}},
        {"compress": {**TOPK_1PCT, "density": 0.03}},
        {"compress": TOPK_1PCT, "ef_decay": 0.9},
        {"compress": "int8", "ef_decay": 0.0},
        {"compress": {**TOPK_1PCT, "density": 0.003}},
    ],
}
"""The issues' sweeps of top-level settings, in the order they run (the targets' rows first)."""


def _top_label(top: dict) -> str:
    """A short name of top-level settings for tables and legends: ``tau=8 naive``, ``F=4``, ``topk 1% int8``."""
    parts = []
    if top.get("delay_steps") is not None:
        parts.append(f"tau={top['delay_steps']}")
        if top.get("delay_correction", "eager") != "eager":
            parts.append("naive" if top["delay_correction"] == "none" else str(top["delay_correction"]))
    if top.get("fragments") is not None:
        parts.append(f"F={top['fragments']}")
    if top.get("delay_mixing") is not None:
        parts.append(f"alpha={top['delay_mixing']}")
    c = top.get("compress")
    if c is not None:
        c = {"type": c} if isinstance(c, str) else c
        if c["type"] == "topk":
            parts.append(f"topk {100 * c['density']:g}% {c.get('values', '')}".rstrip())
        else:
            parts.append(" ".join([c["type"]] + [f"{k} {v}" for k, v in c.items() if k != "type"]))
    if top.get("ef_decay") is not None:
        parts.append("no EF" if top["ef_decay"] == 0 else f"ef_decay {top['ef_decay']:g}")
    known = {"delay_steps", "delay_correction", "fragments", "delay_mixing", "compress", "ef_decay"}
    parts += [f"{k}={json.dumps(v)}" for k, v in top.items() if k not in known]
    return " ".join(parts) or "tau=0, uncompressed"


def _json_safe(value):
    """``value`` with whatever JSON cannot hold (tensors, dtypes) as its ``str``."""
    return json.loads(json.dumps(value, default=str))


CHAR_CONTENDERS: dict[str, tuple[dict[int, int] | None, tuple[int, ...]]] = {
    "sync_dp": (None, ()),
    "local_32": ({32: 8}, ()),
    "hier_2lvl": ({4: 4, 32: 8}, ()),
    "diloco_1lvl": ({32: 8}, (32,)),
    "hier_outer_top": ({4: 4, 32: 8}, (32,)),
    "hier_outer_both": ({4: 4, 32: 8}, (4, 32)),
}
"""name -> (``{period: group_size}``, or None for DDP; the periods with an outer Nesterov optimizer)."""


def _chars_runs(
    contenders: list[str], lrs: list[float], outer_lrs: list[float], tops: list[dict] | None = None
) -> list[tuple[str, float, float | None, dict]]:
    """(contender, inner lr, outer lr, top-level settings) of every run: outer contenders once per outer lr, the
    averaging contenders once per entry of ``tops`` (default ``[{}]``; DDP has no levels, so it runs once)."""
    tops = tops if tops is not None else [{}]
    runs = []
    for top in tops:
        for lr in lrs:
            for name in contenders:
                levels, outer = CHAR_CONTENDERS[name]
                if levels is None and top:
                    continue
                runs += [(name, lr, olr, top) for olr in outer_lrs] if outer else [(name, lr, None, top)]
    return runs


def _chars_rank(rank: int, world_size: int, runs, steps: int, batch: int, context: int, d_model: int,
                outer_momentum: float, seed: int, eval_mean: bool = False):  # fmt: skip
    import time

    import torch
    from chars_common import TinyTransformerLM, averaged_copy, lm_loss, load_char_shard, sample_batch, validation_loss
    from digits_common import replicas_identical

    from hieravg_optim import HierarchicalAveragingOptimizer
    from hieravg_optim.schedule import level_at

    shard = load_char_shard(rank, world_size, context=context)
    # The evaluation's own group: its all-reduces never share a group with a round in flight.
    eval_group = torch.distributed.new_group(list(range(world_size))) if eval_mean else None

    def evaluate(model) -> float:
        if eval_mean:
            return validation_loss(averaged_copy(model, eval_group), shard, eval_group)
        return validation_loss(model, shard)

    out = []
    for name, lr, outer_lr, top in runs:
        levels, outer = CHAR_CONTENDERS[name]
        top_settings = on_level(top, max(levels)) if levels else {}
        model = TinyTransformerLM(d_model=d_model, context=context, seed=seed)
        inner = torch.optim.AdamW(model.parameters(), lr=lr)
        if levels is None:
            net, opt = torch.nn.parallel.DistributedDataParallel(model), inner
            top_period = 32  # evaluated at the steps the averaging contenders' top level averages
        elif outer:
            from hieravg_optim import nesterov_outer

            factories = {p: nesterov_outer(lr=outer_lr, momentum=outer_momentum) for p in outer}
            net, opt = model, HierarchicalAveragingOptimizer(inner, levels, outer_optimizers=factories, **top_settings)
            top_period = max(levels)
        else:
            net, opt = model, HierarchicalAveragingOptimizer(inner, levels, **top_settings)
            top_period = max(levels)
        gen = torch.Generator().manual_seed(seed * 100_003 + rank)  # the same batches for every contender
        curve = [(0, evaluate(model))]
        eval_seconds = 0.0
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for count in range(steps):
            x, y = sample_batch(shard.train, batch, context, gen)
            opt.zero_grad()
            lm_loss(net, x, y).backward()
            opt.step()
            if count % top_period == 0:  # after a top-level round: the replicas are one model (unless delayed)
                t_eval = time.perf_counter()
                curve.append((count + 1, evaluate(model)))
                eval_seconds += time.perf_counter() - t_eval
        seconds = time.perf_counter() - t0 - eval_seconds
        row = {"contender": name, "lr": lr, "outer_lr": outer_lr, "outer_momentum": outer_momentum if outer else None,
               "levels": levels, "outer_periods": list(outer), "curve": curve, "seconds": seconds}  # fmt: skip
        if top:
            row["top"] = top
        strict = not {"delay_steps", "fragments"} & set(top)
        metrics = _count_rounds(row, opt, levels, steps, name, strict)
        if top.get("delay_steps") and hasattr(getattr(opt, "averager", None), "apply_rounds_in_flight"):
            # The end of training: the rounds still in flight (the last top-level round's) applied now, as at
            # their apply count, the local progress being the steps since they started; then evaluated again.
            row["rounds_applied_at_end"] = opt.averager.apply_rounds_in_flight(opt.tensors_to_average())
            if row["rounds_applied_at_end"]:
                row["val_loss_in_flight_applied"] = evaluate(model)
        if metrics is not None:
            assert level_at(steps - 1, levels, 0) == len(levels) - 1, "the run must end on a top-level round"
            row["pseudo_grad_norm_last_round"] = {str(p): metrics[p].get("pseudo_grad_norm") for p in levels}
            if top or eval_mean:
                row["bytes_sent_per_level"] = {str(p): metrics[p]["bytes_sent"] for p in levels}
                row["top_level_metrics"] = _json_safe(metrics[max(levels)])
        row["replicas_identical"] = replicas_identical(list(model.parameters()))
        out.append(row)
        if rank == 0:
            print(f"run {len(out)}/{len(runs)}: {name} lr {lr:g} outer lr {outer_lr} {_top_label(top)}: validation "
                  f"loss {curve[-1][1]:.4f}, {seconds:.0f} s", file=sys.stderr, flush=True)
    return out


def _row_key(r) -> tuple:
    return (r["contender"], r["lr"], r["outer_lr"], r["outer_momentum"], json.dumps(r.get("top", {}), sort_keys=True))


def _plot_chars(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in rows:
        label = f"{r['contender']} (lr {r['lr']:g}" + (
            f", outer lr {r['outer_lr']:g}, momentum {r['outer_momentum']:g})" if r["outer_lr"] else ")"
        )
        style = "-" if r["outer_lr"] else ("--" if r["levels"] else ":")
        ax.plot([c[0] for c in r["curve"][1:]], [c[1] for c in r["curve"][1:]], style, marker="o", ms=2.5,
                label=f"{label}: {r['final_val_loss']:.3f}")  # fmt: skip
    ax.set_xlabel("step (validation after each top-level round: every 32 steps)")
    ax.set_ylabel("validation loss, nats per byte")
    finals = [r["final_val_loss"] for r in rows]
    ax.set_ylim(min(finals) - 0.1, min(finals) + 1.0)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chars_main(args) -> None:
    from chars_common import corpus_fingerprint

    contenders = args.contenders.split(",") if args.contenders else list(CHAR_CONTENDERS)
    contenders = [] if contenders == ["none"] else contenders
    unknown = sorted(set(contenders) - set(CHAR_CONTENDERS))
    if unknown:
        raise SystemExit(f"--contenders: unknown {unknown}; choose from {sorted(CHAR_CONTENDERS)}")
    lrs = [float(v) for v in str(args.lr).split(",")]
    outer_lrs = [float(v) for v in args.outer_lr.split(",")]
    tops = _tops(args)
    runs = _chars_runs(contenders, lrs, outer_lrs, tops)
    for _, _, _, top in runs:
        on_level(top, 32)  # SystemExit, before any spawn, when this hieravg_optim lacks a setting
    env = environment()
    settings = {"steps": args.steps, "batch": args.batch, "context": args.context, "d_model": args.d_model,
                "seed": args.seed, "world_size": 8, "corpus": corpus_fingerprint()}  # fmt: skip
    if args.eval_mean:
        settings["eval"] = "mean of the replicas"
    print(f"{len(runs)} runs: {runs}", flush=True)
    rows = []
    if runs:
        per_rank = spawn(_chars_rank, 8, runs, args.steps, args.batch, args.context, args.d_model,
                         args.outer_momentum, args.seed, args.eval_mean)  # fmt: skip
        rows = per_rank[0]  # the validation losses are all-reduced: the same on every rank
    for r in rows:
        r["final_val_loss"] = r["curve"][-1][1]
        r["environment_load_average"] = env["load_average_1_5_15"]
        r["utc_start"] = env["utc"]
        r["hieravg_optim"] = env["hieravg_optim"]
    path = os.path.join(RESULTS_DIR, f"{args.name}.json")
    redone = {_row_key(r) for r in rows}
    # "--merge" alone (an empty list) merges this run's own earlier file; --merge-baselines takes only the rows
    # without top-level settings of its files.
    merged = [(n, False) for n in ((args.merge or [args.name]) if args.merge is not None else [])]
    for name, baselines_only in merged + [(n, True) for n in args.merge_baselines or []]:
        earlier_path = os.path.join(RESULTS_DIR, f"{name or args.name}.json")
        if not os.path.exists(earlier_path):
            if baselines_only:
                raise SystemExit(f"--merge-baselines: no {earlier_path}")
            continue
        with open(earlier_path) as f:
            earlier = json.load(f)
        if earlier["settings"] != settings:
            raise SystemExit(f"--merge: {earlier_path} has other settings {earlier['settings']}, this run {settings}")
        kept = [r for r in earlier["rows"] if _row_key(r) not in redone and not (baselines_only and r.get("top"))]
        redone |= {_row_key(r) for r in kept}
        rows = kept + rows
    order = list(CHAR_CONTENDERS)
    top_order = [json.dumps(t, sort_keys=True) for t in SWEEPS["delay"] + SWEEPS["compress"]]

    def top_rank(r) -> int:
        key = json.dumps(r.get("top", {}), sort_keys=True)
        return top_order.index(key) if key in top_order else len(top_order)

    rows.sort(key=lambda r: (order.index(r["contender"]), r["lr"], r["outer_lr"] or 0.0, r["outer_momentum"] or 0.0,
                             top_rank(r)))  # fmt: skip

    print(f"\nchars, 8 ranks, {args.steps} steps, batch {args.batch}x{args.context} bytes/rank, "
          f"AdamW inner; load average at start {env['load_average_1_5_15']}")
    hdr = (f"{'contender':>16} {'lr':>7} {'outer lr/m':>8} | {'rounds per level':>22} {'global':>6} | "
           f"{'val loss':>8} {'s':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        rpl = ", ".join(f"{k}: {v}" for k, v in r["rounds_per_level"].items())
        rpl = rpl.replace("grad_allreduce_every_step", "grad")
        outer = f"{r['outer_lr']:g}/{r['outer_momentum']:g}" if r["outer_lr"] else "-"
        print(f"{r['contender']:>16} {r['lr']:7g} {outer:>8} | {rpl:>22} {r['global_rounds']:>6} | "
              f"{r['final_val_loss']:8.4f} {r['seconds']:6.1f}  {_top_label(r['top']) if 'top' in r else ''}")
    checks = _chars_checks(rows)
    sweep = _sweep_checks(rows)
    if sweep["rows"]:
        checks["sweep"] = sweep
    for k, v in checks.items():
        if k != "sweep":
            print(f"{k}: {v}")
    for t in sweep["targets"]:
        print(f"issue {t['issue']}: {t['label']}: {t['what']} = {t['value']:.4f} (target {t['target']}): "
              f"{'met' if t['met'] else 'MISSED'}")
    payload = {"environment": env, "settings": settings, "args": vars(args), "rows": rows, "checks": checks}
    write_json(f"{args.name}.json", payload)
    png = os.path.join(RESULTS_DIR, f"{args.name}.png")
    if any("top" in r for r in rows):
        _plot_sweep(rows, png, f"stdlib bytes, 8 ranks non-IID by file, {args.steps} steps, top-level settings "
                    f"({'mean of the replicas' if args.eval_mean else 'rank 0'} evaluated)")  # fmt: skip
    else:
        best = _best_rows(rows)
        _plot_chars(best, png, f"stdlib bytes, 8 ranks non-IID by file, {args.steps} steps: best inner/outer lr per contender")
    print(f"written: {path}, {png}")


def _tops(args) -> list[dict] | None:
    """The top-level settings to run: ``--top``'s JSON objects, or ``--sweep``'s entries (``--only`` picks some)."""
    if args.top and args.sweep:
        raise SystemExit("--top and --sweep: give one of them")
    if args.sweep:
        tops = SWEEPS[args.sweep]
        if args.only:
            picked = [int(i) for i in args.only.split(",")]
            bad = [i for i in picked if not 0 <= i < len(tops)]
            if bad:
                raise SystemExit(f"--only: {bad} are not entries of --sweep {args.sweep} (0..{len(tops) - 1})")
            tops = [tops[i] for i in picked]
        return tops
    if args.only:
        raise SystemExit("--only picks entries of a --sweep: give --sweep delay or --sweep compress")
    if not args.top:
        return None
    tops = []
    for text in args.top:
        try:
            top = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--top {text!r} is not JSON ({exc}); give an object, e.g. '{{\"delay_steps\": 8}}'") from None
        if not isinstance(top, dict):
            raise SystemExit(f"--top {text!r} must be a JSON object of AveragingConfig keywords, e.g. '{{\"fragments\": 4}}'")
        tops.append(top)
    return tops


SWEEP_TARGETS: list[tuple[int, dict, str, float, float | None]] = [
    # (issue, top-level settings, what, the largest final validation loss / baseline, the largest bytes / baseline)
    (24, {"delay_steps": 8}, "tau=8 eager", 1.01, None),
    (25, {"compress": "int8"}, "int8", 1.005, 0.26),
    (25, {"compress": TOPK_1PCT}, "topk 1% int8", 1.02, 0.03),
]
"""The targets of issues 24 and 25 on the chars LM, each against the ``{}`` row of the same contender and lrs."""


def _baseline_key(r) -> tuple:
    return (r["contender"], r["lr"], r["outer_lr"], r["outer_momentum"])


def _last_evals_ratio(row, base, n: int) -> float | None:
    """The mean over the last ``n`` evaluations (the same counts in both rows) of ``row``'s validation loss over
    ``base``'s: less sensitive than the final one to where the last round stands at the end of the run."""
    got, ref = dict(row["curve"]), dict(base["curve"])
    counts = sorted(set(got) & set(ref))[-n:]
    return sum(got[c] / ref[c] for c in counts) / len(counts) if len(counts) == n else None


def _sweep_checks(rows) -> dict:
    """Each row with top-level settings against the row without them (same contender and lrs), and the targets.

    Per row, from ``metrics()`` over the same rounds: final validation loss / the baseline's; the top level's
    ``payload_bytes`` (what a rank puts on the wire per round: the fp32 tensors for an all-reduce, its payload for
    an all-gather; a compressed level's first round, before its anchors, is uncompressed) / the baseline's; its
    ``bytes_sent`` (what the collective sends per rank: 2 (n - 1) / n x the payload for a ring all-reduce,
    (n - 1) x for an all-gather) / the baseline's; for a compressed level its ``compression_ratio`` (bytes sent
    compressed / by an fp32 all-reduce) and the payload of a compressed round / its fp32 tensors. A target is
    met when the loss ratio and (compressed) the payload ratio per compressed round are at most the target's. A
    delayed run that applied its rounds in flight after the last step (``apply_rounds_in_flight``) has its loss
    then checked too, as a target row of its own.
    """
    base = {_baseline_key(r): r for r in rows if not r.get("top") and "bytes_sent_per_level" in r}
    out: dict = {"rows": [], "targets": []}
    for r in rows:
        b = base.get(_baseline_key(r))
        if b is None or "top" not in r:
            continue
        top = str(max(int(p) for p in r["bytes_sent_per_level"]))
        m = r["top_level_metrics"]
        payload, base_payload = m.get("payload_bytes"), b["top_level_metrics"].get("payload_bytes")
        # metrics() of a compressed level: compressed_bytes = (n - 1) x the payloads its all-gathers sent,
        # uncompressed_bytes = 2 (n - 1) / n x the fp32 bytes a ring all-reduce would have sent, over the same
        # (compressed) rounds; so payload / fp32 per compressed round = compression_ratio x 2 / n (flat levels).
        codec_ratio = m["compression_ratio"] * 2 / m["group_size"] if m.get("compression_ratio") is not None else None
        ratio = {"label": _top_label(r["top"]), "top": r["top"], "contender": r["contender"], "lr": r["lr"],
                 "outer_lr": r["outer_lr"], "outer_momentum": r["outer_momentum"],
                 "loss_over_baseline": r["final_val_loss"] / b["final_val_loss"],
                 "loss_over_baseline_last4": _last_evals_ratio(r, b, 4),
                 "payload_over_baseline": payload / base_payload if payload is not None and base_payload else None,
                 "compression_ratio": m.get("compression_ratio"), "payload_over_fp32_compressed_rounds": codec_ratio,
                 "bytes_over_baseline": r["bytes_sent_per_level"][top] / b["bytes_sent_per_level"][top]}  # fmt: skip
        if "val_loss_in_flight_applied" in r:
            ratio["applied_loss_over_baseline"] = r["val_loss_in_flight_applied"] / b["final_val_loss"]
        out["rows"].append(ratio)
        for issue, settings, label, max_loss, max_bytes in SWEEP_TARGETS:
            if json.dumps(r["top"], sort_keys=True) != json.dumps(settings, sort_keys=True):
                continue
            tag = f"{label}, {r['contender']} lr {r['lr']:g} outer {r['outer_lr']}/{r['outer_momentum']}"
            loss = ratio["loss_over_baseline"]
            out["targets"].append({"issue": issue, "label": tag, "what": "final validation loss / baseline",
                                   "value": loss, "target": f"<= {max_loss:g}", "met": loss <= max_loss})  # fmt: skip
            if "applied_loss_over_baseline" in ratio:
                loss = ratio["applied_loss_over_baseline"]
                out["targets"].append({"issue": issue, "label": tag, "value": loss, "target": f"<= {max_loss:g}",
                                       "what": "final validation loss, the round in flight applied at the end, / "
                                       "baseline", "met": loss <= max_loss})  # fmt: skip
            if max_bytes is not None:
                nb = ratio["payload_over_fp32_compressed_rounds"]
                out["targets"].append({"issue": issue, "label": tag, "what": "payload / fp32, per compressed round",
                                       "value": float("nan") if nb is None else nb, "target": f"<= {max_bytes:g}",
                                       "met": nb is not None and nb <= max_bytes})  # fmt: skip
    return out


def _plot_sweep(rows, path, title):
    """Every row's validation curve, labelled by its top-level settings (one plot per sweep file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = len({(r["contender"], r["outer_lr"], r["outer_momentum"]) for r in rows}) > 1
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(17 if several else 13, 5.5))
    colors = plt.cm.tab20.colors if len(rows) > 10 else plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(rows):
        top = r.get("top", {})
        label = f"{_top_label(top)}: {r['final_val_loss']:.4f}"
        if several:  # name the contender (and its outer optimizer) when the file holds more than one
            outer = f" {r['outer_lr']:g}/{r['outer_momentum']:g}" if r["outer_lr"] else ""
            label = f"{r['contender']}{outer}, {label}"
        style = "--" if top.get("delay_correction") == "none" or top.get("ef_decay") == 0 else "-"
        xs, ys = [c[0] for c in r["curve"][1:]], [c[1] for c in r["curve"][1:]]
        color = colors[i % len(colors)]
        ax.plot(xs, ys, style, marker="o", ms=2.5, label=label, color=color)
        zoom.plot(xs, ys, style, marker="o", ms=2.5, label=label, color=color)
    finals = [r["final_val_loss"] for r in rows]
    ax.set_ylim(min(finals) - 0.1, max(min(finals) + 1.0, max(finals) + 0.3))
    zoom.set_xlim(rows[0]["curve"][-1][0] * 0.6, rows[0]["curve"][-1][0] * 1.02)
    zoom.set_ylim(min(finals) - 0.03, max(finals) + 0.08)
    for a in (ax, zoom):
        a.set_xlabel("step (validation every 32 steps)")
        a.set_ylabel("validation loss, nats per byte")
    zoom.set_title("the last 40% of the run", fontsize=10)
    ax.set_title(title, fontsize=9)
    if several:  # outside the plot: one line per row
        zoom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        zoom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _best_rows(rows) -> list[dict]:
    """Per contender, the row with the lowest final validation loss (over the swept lrs)."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["contender"] not in best or r["final_val_loss"] < best[r["contender"]]["final_val_loss"]:
            best[r["contender"]] = r
    return [best[name] for name in CHAR_CONTENDERS if name in best]


def _chars_checks(rows) -> dict:
    """The goal of the DiLoCo contenders, on the best row of each contender (lrs swept)."""
    best = {r["contender"]: r for r in _best_rows(rows)}
    checks: dict = {}
    if {"sync_dp", "hier_outer_top"} <= set(best):
        dp, top = best["sync_dp"], best["hier_outer_top"]
        checks["hier_outer_top_over_sync_dp"] = top["final_val_loss"] / dp["final_val_loss"]
        checks["hier_outer_top_within_3pct_of_sync_dp"] = top["final_val_loss"] <= 1.03 * dp["final_val_loss"]
        checks["global_rounds_sync_dp_over_hier"] = dp["global_rounds"] / top["global_rounds"]
    if {"hier_2lvl", "hier_outer_top"} <= set(best):
        checks["hier_outer_top_below_hier_2lvl"] = (
            best["hier_outer_top"]["final_val_loss"] < best["hier_2lvl"]["final_val_loss"]
        )
    checks["best"] = {name: {"lr": r["lr"], "outer_lr": r["outer_lr"], "outer_momentum": r["outer_momentum"],
                             "final_val_loss": r["final_val_loss"]} for name, r in best.items()}  # fmt: skip
    return checks


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for col, split in enumerate(("iid", "non_iid")):
        for r in (r for r in rows if r["split"] == split):
            steps = [c[0] for c in r["curve"]]
            axes[0, col].plot(steps, [c[1] for c in r["curve"]], label=r["contender"])
            axes[1, col].plot(steps, [100 * c[3] for c in r["curve"]], label=r["contender"])
        axes[0, col].set_title(f"{split.replace('_', '-').upper()}: training loss of the averaged model")
        axes[0, col].set_yscale("log")
        axes[1, col].set_title(f"{split.replace('_', '-').upper()}: test accuracy (%) of the averaged model")
        axes[1, col].set_xlabel("step")
        axes[1, col].set_ylim(80, 100)
        axes[0, col].legend(fontsize=8)
    fig.suptitle("digits, 8 ranks, MLP, SGD momentum 0.9 (bench/convergence.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("digits", "chars"), default="digits")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (digits: 640, a multiple of 32; chars: 513 = 16 x 32 + 1)")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch size (windows for chars)")
    parser.add_argument("--lr", default=None,
                        help="inner lr (digits: SGD, 0.02; chars: AdamW, 6e-3, or a comma-separated list to sweep)")
    parser.add_argument("--hidden", type=int, default=64, help="digits: MLP width")
    parser.add_argument("--eval-every", type=int, default=16, help="digits: evaluate every N steps")
    parser.add_argument("--context", type=int, default=64, help="chars: bytes per window")
    parser.add_argument("--d-model", type=int, default=64, help="chars: transformer width")
    parser.add_argument("--seed", type=int, default=0, help="chars: init and batch sampling")
    parser.add_argument("--contenders", default=None,
                        help=f"chars: comma-separated subset of {list(CHAR_CONTENDERS)}, or none")
    parser.add_argument("--outer-lr", default="0.7", help="chars: outer Nesterov lr, or a comma-separated list")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="chars: outer Nesterov momentum")
    parser.add_argument("--top", nargs="+", default=None, metavar="JSON",
                        help="chars: run each averaging contender once per JSON object of AveragingConfig keywords, "
                        "each value put on the top level only, e.g. '{}' '{\"delay_steps\": 8}'")
    parser.add_argument("--sweep", choices=sorted(SWEEPS), default=None,
                        help="chars: --top with the issue's sweep (issue 24: delay, issue 25: compress)")
    parser.add_argument("--only", default=None, help="chars: comma-separated 0-based entries of --sweep to run")
    parser.add_argument("--eval-mean", action="store_true",
                        help="chars: evaluate the mean of the replicas (own process group) instead of rank 0's model")
    parser.add_argument("--merge", nargs="*", default=None, metavar="NAME",
                        help="chars: keep the rows of bench/results/NAME.json (default: this run's own file) that this "
                        "run does not redo; with --contenders none, only merge")
    parser.add_argument("--merge-baselines", nargs="+", default=None, metavar="NAME",
                        help="chars: as --merge, only the rows without top-level settings (the baselines of a sweep)")
    parser.add_argument("--name", default=None,
                        help="output files bench/results/NAME.* (default: convergence / convergence_chars)")
    args = parser.parse_args()
    if args.task == "chars":
        args.steps = args.steps or 513
        args.lr = args.lr or "6e-3"
        args.name = args.name or "convergence_chars"
        chars_main(args)
        return
    args.steps = args.steps or 640
    args.lr = float(args.lr or 0.02)
    args.name = args.name or "convergence"
    env = environment()
    per_rank = spawn(_rank, 8, args.steps, args.batch, args.lr, args.hidden, args.eval_every)
    rows = per_rank[0]  # the averaged-model evaluations are identical on every rank
    for r in rows:
        r["final_train_loss"] = r["curve"][-1][1]
        r["final_test_loss"] = r["curve"][-1][2]
        r["final_test_accuracy"] = r["curve"][-1][3]

    print(f"\ndigits, 8 ranks, {args.steps} steps, batch {args.batch}/rank, SGD lr {args.lr} momentum 0.9, "
          f"MLP hidden {args.hidden}; load average at start {env['load_average_1_5_15']}")
    hdr = f"{'split':>8} {'contender':>10} | {'rounds per level':>34} {'global':>6} | {'train loss':>10} {'test acc %':>10} {'s':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        rpl = ", ".join(f"{k}: {v}" for k, v in r["rounds_per_level"].items())
        print(f"{r['split']:>8} {r['contender']:>10} | {rpl:>34} {r['global_rounds']:>6} | "
              f"{r['final_train_loss']:10.4f} {100 * r['final_test_accuracy']:10.2f} {r['seconds']:6.1f}")
    checks = {}
    for split in ("iid", "non_iid"):
        by = {r["contender"]: r for r in rows if r["split"] == split}
        checks[split] = {
            "loss_local4_le_hier_le_local32": by["local_4"]["final_train_loss"] <= by["hier_2lvl"]["final_train_loss"]
            <= by["local_32"]["final_train_loss"],
            "hier_acc_minus_sync_points": 100 * (by["hier_2lvl"]["final_test_accuracy"] - by["sync_dp"]["final_test_accuracy"]),
            "global_round_ratio_sync_over_hier": by["sync_dp"]["global_rounds"] / by["hier_2lvl"]["global_rounds"],
        }
        c = checks[split]
        print(f"{split}: loss(local_4) <= loss(hier_2lvl) <= loss(local_32): {c['loss_local4_le_hier_le_local32']}; "
              f"acc(hier_2lvl) - acc(sync_dp) = {c['hier_acc_minus_sync_points']:+.2f} points (expected >= -0.7); "
              f"global rounds sync/hier = {c['global_round_ratio_sync_over_hier']:.0f}x")
    payload = {"environment": env, "args": vars(args), "rows": rows, "checks": checks}
    path = write_json(f"{args.name}.json", payload)
    csv_path = os.path.join(RESULTS_DIR, f"{args.name}.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["split", "contender", "step", "train_loss_avg_model", "test_loss_avg_model", "test_accuracy_avg_model"])
        for r in rows:
            for c in r["curve"]:
                w.writerow([r["split"], r["contender"], *c])
    png = os.path.join(RESULTS_DIR, f"{args.name}.png")
    _plot(rows, png)
    print(f"written: {path}, {csv_path}, {png}")


if __name__ == "__main__":
    main()
