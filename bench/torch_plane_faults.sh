#!/usr/bin/env bash
# A neighbour's death on the torch plane, through `hopnet launch` (issue 18; docs/performance/index.md,
# "Faults: detection, restarts, recovery"): examples/train_cnn.py, 4 workers on ring:4, --bulk torch; once
# rank 2's event log shows iteration 20 it gets SIG (KILL or STOP). Prints the run's end and, for each
# neighbour of rank 2, seconds from the signal to its peer_dead record (the machine's monotonic clock).
#
#   WT=/path/to/checkout bench/torch_plane_faults.sh NAME KILL|STOP [launch flags...]
#   e.g. bench/torch_plane_faults.sh k1 KILL --bulk torch --backup-workers 1 --max-failures 1 --timeout 30
#
# WT: the checkout whose hopnet runs (default: this one); runs go to ${OUT:-/tmp/torch_plane_faults}/NAME.
WT=${WT:-$(cd "$(dirname "$0")/.." && pwd)}
OUT=${OUT:-/tmp/torch_plane_faults}
name=$1; sig=$2; shift 2
mkdir -p "$OUT"; d=$OUT/$name; rm -rf "$d" "$d.out"
( cd "$WT" && PYTHONPATH=$WT timeout 300 python -m hopnet.cli.main launch --nproc 4 --no-progress --run-dir "$d" "$@" \
    examples/train_cnn.py --iterations "${ITERS:-200}" > "$d.out" 2>&1; echo "exit=$?" >> "$d.out" ) &
lp=$!
for _ in $(seq 1 900); do
  if [ -f "$d/rank2.jsonl" ] && grep -q '"iteration".*"iter":2[0-9]' "$d/rank2.jsonl" 2>/dev/null; then break; fi
  sleep 0.1
done
pid=$(python -c "import json;print(json.load(open('$d/launch.json'))['worker_pids']['2'])")
mono=$(python -c "import time;print(time.monotonic())"); kill "-$sig" "$pid"
wait $lp
echo "== $name ($*) SIG$sig: $(tail -1 "$d.out")"
python - "$d" "$mono" <<'PY'
import json, sys
d, mono = sys.argv[1], float(sys.argv[2])
for rank in (1, 3):
    recs = [json.loads(line) for line in open(f"{d}/rank{rank}.jsonl") if line.endswith("}\n")]
    dead = [r for r in recs if r["event"] == "peer_dead" and r["peer"] == 2]
    err = [r["message"] for r in recs if r["event"] == "error"]
    when = f"{dead[0]['mono'] - mono:.2f} s" if dead else "never"
    print(f"  rank {rank}: peer_dead {when} after the signal" + (f"; error: {err[0]}" if err else ""))
PY
grep -E "lost rank|failed in|finished in" "$d.out" | tail -2
