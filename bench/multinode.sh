#!/usr/bin/env bash
# Two simulated nodes on one machine, joined by a bandwidth-limited link: DDP vs hierarchical averaging.
#
#   sudo bench/multinode.sh            # as root (network namespaces); about 5 minutes on 2 CPU cores
#   STEPS=32 PERIOD=16 RATE=200mbit WIDTH=3072 BATCH=16 bench/multinode.sh
#
# Network: two Linux network namespaces, each a "node", joined by a veth pair created inside
# them (10.213.0.1/24 <-> 10.213.0.2/24); both ends shaped with a token bucket (tc tbf, RATE).
# Nothing is added to the host's own namespace; all traffic goes to those two addresses. Inside
# a node, ranks talk over the node's own address (local, unshaped); across nodes, over the link.
#
# Runs, one after the other, each as two `torchrun --nnodes 2 --nproc_per_node 2` (one per node):
#   ddp:  DistributedDataParallel over the 4 ranks (a gradient all-reduce crosses the link every step);
#   hier: HierarchicalAveragingOptimizer {1: 2, PERIOD: 4} (average inside a node every step,
#         across nodes every PERIOD steps);
#   hier_node (with MODES="ddp hier hier_node"): the same, the cross-node level node-aware
#         (ranks_per_node=2: reduce-scatter in the node, all-reduce across, all-gather);
#   hier_delay, hier_frag, hier_delay_frag: hier with delay_steps=DELAY_STEPS (default 8), fragments=FRAGMENTS
#         (default 4), or both (the delay then one below the fragment spacing PERIOD / FRAGMENTS) on the
#         cross-node level (issue 24; compared with hier);
#   hier_node_delay: hier_node with delay_steps=DELAY_STEPS on the cross-node level (issue 24; compared with
#         hier_node): a round is hidden only when it fits in DELAY_STEPS inner steps, and the node-aware round
#         moves half the ring's bytes across the link; hier_node_delay_frag: hier_node with FRAGMENTS fragments
#         and the delay one below their spacing;
#   hier_node_int8, hier_node_topk: hier_node with the cross-node level compressed, int8 or top-k of density
#         TOPK_DENSITY (default 0.01) with int8 values (issue 25; compared with hier_node).
#   hier_node_int8_delay: hier_node_int8 with delay_steps=DELAY_STEPS (issues 24 and 25; compared with
#         hier_node_int8).
# MODES (default "ddp hier") picks the runs, in that order. The issue-24 and issue-25 modes need a
# hieravg_optim with those settings (PYTHONPATH=...); the summary prints each target's ratio, met or missed.
# Model: a ~19M-parameter MLP on the digits data (bench/multinode_train.py). Reported: wall-clock
# seconds per step (slowest rank), final training loss and test accuracy of the averaged model.
# Results: printed, and bench/results/multinode.json.
#
# The namespaces are removed on exit (trap). Where they cannot be made (not root, no iproute2,
# no tbf), the script prints SKIP and the reason and exits 0. Every run has a timeout.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi
fi
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
STEPS="${STEPS:-32}"
PERIOD="${PERIOD:-16}"
RATE="${RATE:-200mbit}"
WIDTH="${WIDTH:-3072}"
BATCH="${BATCH:-16}"
RUN_TIMEOUT="${RUN_TIMEOUT:-900}"
DELAY_STEPS="${DELAY_STEPS:-8}"
FRAGMENTS="${FRAGMENTS:-4}"
TOPK_DENSITY="${TOPK_DENSITY:-0.01}"
MODES="${MODES:-ddp hier}"
OUT_NAME="${OUT_NAME:-multinode.json}"
NS0="hvbench0-$$"
NS1="hvbench1-$$"
ADDR0=10.213.0.1
ADDR1=10.213.0.2
PIDS=()
WORK="$(mktemp -d /tmp/hieravg-multinode-XXXXXX)"

skip() { echo "SKIP: $*"; exit 0; }

cleanup() {
  for pid in "${PIDS[@]:-}"; do
    [ -n "$pid" ] && kill "$pid" 2>/dev/null
  done
  for pid in "${PIDS[@]:-}"; do
    [ -n "$pid" ] && wait "$pid" 2>/dev/null
  done
  ip netns del "$NS0" 2>/dev/null
  ip netns del "$NS1" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ "$(id -u)" = 0 ] || skip "network namespaces need root (run with sudo)."
command -v ip >/dev/null || skip "iproute2 'ip' not found (apt-get install iproute2)."
command -v tc >/dev/null || skip "iproute2 'tc' not found (apt-get install iproute2)."
[ -x "$(dirname "$PY")/torchrun" ] || skip "torchrun not found next to $PY."

# Every mode's settings, checked against this hieravg_optim before anything runs (no process group).
for mode in $MODES; do
  "$PY" "$ROOT/bench/multinode_train.py" --check --mode "$mode" --period "$PERIOD" --delay-steps "$DELAY_STEPS" \
    --fragments "$FRAGMENTS" --topk-density "$TOPK_DENSITY" --out /dev/null || exit 2
done

ip netns add "$NS0" 2>"$WORK/err" || skip "cannot create a network namespace: $(cat "$WORK/err")"
ip netns add "$NS1" 2>"$WORK/err" || skip "cannot create a network namespace: $(cat "$WORK/err")"
ip -n "$NS0" link add v0 type veth peer name v1 netns "$NS1" 2>"$WORK/err" \
  || skip "cannot create a veth pair between the namespaces: $(cat "$WORK/err")"
ip -n "$NS0" addr add "$ADDR0/24" dev v0
ip -n "$NS1" addr add "$ADDR1/24" dev v1
for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
ip -n "$NS0" link set v0 up
ip -n "$NS1" link set v1 up
tc -n "$NS0" qdisc add dev v0 root tbf rate "$RATE" burst 256kb latency 50ms 2>"$WORK/err" \
  || skip "cannot shape the link with tc tbf: $(cat "$WORK/err")"
tc -n "$NS1" qdisc add dev v1 root tbf rate "$RATE" burst 256kb latency 50ms 2>"$WORK/err" \
  || skip "cannot shape the link with tc tbf: $(cat "$WORK/err")"
echo "nodes: $NS0 ($ADDR0, v0) <-> $NS1 ($ADDR1, v1), link shaped to $RATE each way"
tc -n "$NS0" qdisc show dev v0

# A free port on node 0's address, picked now (the namespace is fresh, but never hard-code one).
PORT="$(ip netns exec "$NS0" "$PY" -c "import socket; s=socket.socket(); s.bind(('$ADDR0', 0)); print(s.getsockname()[1]); s.close()")"

# Measure the link once: push 20 MB from node 1 to node 0 over TCP.
LINK_MBPS="$(ip netns exec "$NS0" "$PY" - "$NS1" "$ADDR0" "$PY" <<'EOF'
import socket, subprocess, sys, time
ns1, addr, py = sys.argv[1:4]
srv = socket.socket(); srv.bind((addr, 0)); srv.listen(1)
port = srv.getsockname()[1]
n = 20_000_000
sender = subprocess.Popen(["ip", "netns", "exec", ns1, py, "-c",
    f"import socket; s=socket.create_connection(('{addr}', {port})); s.sendall(b'x' * {n}); s.close()"])
conn, _ = srv.accept(); got = 0; t0 = None
while True:
    b = conn.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    got += len(b)
dt = time.perf_counter() - t0
sender.wait()
print(f"{got * 8 / dt / 1e6:.0f}")
EOF
)"
echo "measured link throughput node1 -> node0: ${LINK_MBPS} Mbit/s"

run_mode() {
  local mode="$1"
  local common=(--nnodes 2 --nproc_per_node 2 --master_addr "$ADDR0" --master_port "$PORT"
    "$ROOT/bench/multinode_train.py" --mode "$mode" --steps "$STEPS" --period "$PERIOD"
    --width "$WIDTH" --batch "$BATCH" --delay-steps "$DELAY_STEPS" --fragments "$FRAGMENTS"
    --topk-density "$TOPK_DENSITY" --out "$WORK/$mode.json")
  echo "== $mode: $STEPS steps =="
  ip netns exec "$NS0" env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=v0 \
    timeout "$RUN_TIMEOUT" "$(dirname "$PY")/torchrun" --node_rank 0 "${common[@]}" >"$WORK/$mode.node0.log" 2>&1 &
  PIDS+=($!)
  local p0=$!
  ip netns exec "$NS1" env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=v1 \
    timeout "$RUN_TIMEOUT" "$(dirname "$PY")/torchrun" --node_rank 1 "${common[@]}" >"$WORK/$mode.node1.log" 2>&1 &
  PIDS+=($!)
  local p1=$!
  local rc0=0 rc1=0
  wait "$p0" || rc0=$?
  wait "$p1" || rc1=$?
  if [ "$rc0" != 0 ] || [ "$rc1" != 0 ] || [ ! -s "$WORK/$mode.json" ]; then
    echo "FAILED: $mode (exit codes $rc0, $rc1; 124 = timeout after ${RUN_TIMEOUT}s)"
    grep -v "^\s*$" "$WORK/$mode.node0.log" "$WORK/$mode.node1.log" | grep -B 3 -A 25 -m 4 "Traceback" | head -n 120
    exit 1
  fi
}

LOAD_AT_START="$(cut -d' ' -f1-3 /proc/loadavg)"
for mode in $MODES; do run_mode "$mode"; done

# -P: the hieravg_optim of PYTHONPATH (the runs' own), not the one in the current folder.
"$PY" -P - "$WORK" "$RATE" "$LINK_MBPS" "$LOAD_AT_START" "$ROOT/bench/results/$OUT_NAME" "$MODES" <<'EOF'
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
from _common import environment
from report import multinode_modes
work, rate, mbps, load, out, modes = sys.argv[1:7]
runs = {m: json.load(open(os.path.join(work, f"{m}.json"))) for m in modes.split()}
h = runs.get("hier")
speedup = runs["ddp"]["seconds_per_step_mean"] / h["seconds_per_step_mean"] if "ddp" in runs and h else None
env = environment()
env["load_average_at_start"] = load
env["command"] = "bench/multinode.sh"
result = {"environment": env, "rate": rate, "measured_link_mbit_s": float(mbps), "runs": runs,
          "speedup_ddp_over_hier_per_step": speedup}
print()
print(multinode_modes(result), end="")
for name, r in runs.items():
    for p, m in r.get("metrics", {}).items():
        print(f"{name} level period {p}: {m['rounds']} rounds, {m['bytes_sent'] / 1e6:.0f} MB sent by rank 0, {m['seconds']:.1f} s")
os.makedirs(os.path.dirname(out), exist_ok=True)
json.dump(result, open(out, "w"), indent=2)
print(f"written: {out}")
EOF
