"""Convergence of hierarchical averaging against synchronous data parallelism and local SGD.

Run (a few minutes on 2 CPU cores)::

    OMP_NUM_THREADS=1 python bench/convergence.py

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
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from _common import RESULTS_DIR, environment, spawn, write_json  # noqa: E402

CONTENDERS = {
    "sync_dp": None,
    "local_4": {4: 8},
    "local_32": {32: 8},
    "hier_2lvl": {4: 4, 32: 8},
    "hier_3lvl": {2: 2, 4: 4, 32: 8},
}


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
    from hieravg_optim.schedule import AveragingLevel, rounds_per_level

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
            if levels is None:
                row["global_rounds"] = steps  # one gradient all-reduce over all ranks per step
                row["rounds_per_level"] = {"grad_allreduce_every_step": steps}
            else:
                metrics = opt.metrics()
                expected = rounds_per_level(0, steps, [AveragingLevel(p, g) for p, g in levels.items()], 0)
                got = [metrics[p]["rounds"] for p in levels]
                assert got == expected, f"{name}: rounds per level {got} != rounds_per_level {expected}"
                row["rounds_per_level"] = {str(p): metrics[p]["rounds"] for p in levels}
                row["bytes_sent_per_level"] = {str(p): metrics[p]["bytes_sent"] for p in levels}
                row["global_rounds"] = metrics[max(levels)]["rounds"]
            out.append(row)
            if levels is None:
                del net
    return out


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
    parser.add_argument("--steps", type=int, default=640, help="optimizer steps per run (a multiple of 32)")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--name", default="convergence", help="output files bench/results/NAME.{json,csv,png}")
    args = parser.parse_args()
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
