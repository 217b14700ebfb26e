"""A synthetic hopnet workload: sleep-emulated compute and a real parameter vector.

Run it under the launcher, e.g.::

    hopnet launch --graph ring_based:16 --slowdown random:6:0.0625 \\
        examples/synthetic.py --compute-ms 50 --model-mb 0.1 --iterations 200 --warmup 20

Each iteration "computes" by ``time.sleep(compute_ms)`` - so 16 workers fit on a
2-core machine and a slowdown (``--slowdown``, applied by ``Worker.step``, which
stretches the time since the previous step returned) is exact - and then finishes
the iteration with the protocol: the float32 parameter vector of ``--model-mb`` MB
(10^6 bytes) is sent to the out-neighbours and mixed with the in-neighbours' vectors
for real. There are no gradients; the "optimizer step" is a trivial deterministic
update, ``params += 1e-6``, applied where Hop's Apply goes (``--no-apply`` drops it).

At the end each worker prints its rate - iterations per second measured on its own
clock over the iterations after ``--warmup`` (skipped iterations, when skipping is
on, count as iterations advanced) - and records it in its event log as a ``rate``
event: ``{"event": "rate", "rate": R, "iterations": N, "seconds": S, ...}``.

With ``--consensus`` the workers then average their parameter vectors
(``worker.consensus()``) and the lowest live rank prints the mean it holds.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import hopnet

BYTES_PER_MB = 1_000_000
FAKE_STEP = 1e-6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compute-ms", type=float, default=50.0,
                        help="emulated compute per iteration, in ms (a sleep; default: 50)")
    parser.add_argument("--model-mb", type=float, default=0.1,
                        help="size of the float32 parameter vector in MB of 10^6 bytes (default: 0.1)")
    parser.add_argument("--iterations", type=int, default=200, help="iterations to run (default: 200)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="iterations left out of the rate (default: 20)")
    parser.add_argument("--no-apply", action="store_true", help="skip the fake update")
    parser.add_argument("--quiet", action="store_true", help="do not print the rate")
    parser.add_argument("--consensus", action="store_true",
                        help="end with worker.consensus(): every live worker holds the mean parameters")
    args = parser.parse_args()
    if args.iterations < 1 or args.warmup < 0 or args.warmup >= args.iterations:
        parser.error("need iterations >= 1 and 0 <= warmup < iterations")
    if args.compute_ms < 0 or args.model_mb < 0:
        parser.error("--compute-ms and --model-mb must be >= 0")

    torch.set_num_threads(1)
    rank = int(os.environ.get("HOPNET_RANK", "0"))
    numel = max(1, int(args.model_mb * BYTES_PER_MB) // 4)
    params = torch.full((numel,), float(rank), dtype=torch.float32)  # ranks start apart: mixing shows
    worker = hopnet.init(params=params)

    compute_s = args.compute_ms / 1000.0
    apply = None if args.no_apply else (lambda: params.add_(FAKE_STEP))
    sleep, step, now = time.sleep, worker.step, time.perf_counter
    warmup = args.warmup
    t_start = None       # when iteration `warmup` (or the first one past it) began
    first = None         # that iteration's number
    last = 0
    for k in worker.iterations(args.iterations):
        if t_start is None and k >= warmup:
            t_start, first = now(), k
        if compute_s:
            sleep(compute_s)
        step(apply)
        last = k
    t_end = now()
    done = last + 1 - first if first is not None else 0
    seconds = t_end - t_start if t_start is not None else 0.0
    rate = done / seconds if seconds > 0 else 0.0
    worker.record("rate", rate=rate, iterations=done, seconds=round(seconds, 6), warmup=warmup,
                  compute_ms=args.compute_ms, model_mb=args.model_mb)
    if args.consensus:
        consensus = worker.consensus()
        if worker.rank == consensus.members[0]:
            print(f"consensus of ranks {', '.join(map(str, consensus.members))}: param mean "
                  f"{float(params.mean()):.6g}", flush=True)
    worker.close()
    if not args.quiet:
        print(f"{rate:.4f} iterations/s over iterations {first}..{last} ({seconds:.3f} s); "
              f"param mean {float(params.mean()):.6g}", flush=True)


if __name__ == "__main__":
    main()
