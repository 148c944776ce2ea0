"""Step time with the metric collector on vs off, measured side by side in one process.

The same training loop (a real torchtune Llama3 of a few layers, AdamW, forward + backward +
optimizer step on CPU, ~50-200 ms per step) logs every step either through the user's plain
``DiskLogger`` (off) or through ``CollectorLogger`` wrapping the same kind of ``DiskLogger``
(on). Steps run in adjacent on/off pairs with alternating order, so load from other processes
hits both modes alike; the headline is the median over pairs of (on step / off step), target
<= 1.01. Also printed: ratio of medians, CPU-time ratio, and the cost of one ``log_dict`` call
measured in isolation. Exit status 1 when the target is missed.

    .venv/bin/python benchmarks/collector_overhead.py [--steps 60] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="measured step pairs (default 60)")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured steps first (default 5)")
    ap.add_argument("--layers", type=int, default=2, help="Llama3 layers (default 2)")
    ap.add_argument("--embed-dim", type=int, default=256, help="model width (default 256)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()

    import torch
    from torchtune.models.llama3 import llama3
    from torchtune.training.metric_logging import DiskLogger
    from tqdm import tqdm

    from hlmtune.profiling.collector import CollectorLogger

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = 2048
    model = llama3(vocab_size=vocab, num_layers=args.layers, num_heads=args.embed_dim // 64,
                   num_kv_heads=max(1, args.embed_dim // 128), embed_dim=args.embed_dim,
                   max_seq_len=args.seq_len, intermediate_dim=2 * args.embed_dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1))  # (B, T+1)

    def train_step() -> float:
        logits = model(tokens[:, :-1])  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    tmp = Path(tempfile.mkdtemp(prefix="collector_overhead_"))
    off = DiskLogger(log_dir=str(tmp / "off"))
    on = CollectorLogger(log_dir=str(tmp / "on" / "metrics"), wrapped=DiskLogger(log_dir=str(tmp / "on" / "logs")))
    loggers = {"off": off, "on": on}
    times = {"off": [], "on": []}
    cpu = {"off": [], "on": []}
    pair_ratios = []
    ntok = args.batch_size * args.seq_len
    step = {"off": 0, "on": 0}

    def one(mode: str) -> tuple:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = train_step()
        dt_train = time.perf_counter() - t0
        step[mode] += 1
        loggers[mode].log_dict({"loss": loss, "lr": 1e-4, "tokens_per_second_per_gpu": ntok / dt_train}, step=step[mode])
        return time.perf_counter() - t0, time.process_time() - c0

    for _ in range(args.warmup):
        one("off")
        one("on")
    for i in tqdm(range(args.steps), desc="step pairs", file=sys.stderr):
        # Adjacent pairs, order alternating (on-off, off-on): both modes see the same load.
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        res = {m: one(m) for m in order}
        for m in order:
            times[m].append(res[m][0])
            cpu[m].append(res[m][1])
        pair_ratios.append(res["on"][0] / res["off"][0])

    # log_dict cost alone (no training), many calls.
    n = 2000
    cost = {}
    for mode, lg in loggers.items():
        t0 = time.perf_counter()
        for j in range(n):
            lg.log_dict({"loss": 1.0, "lr": 1e-4, "tokens_per_second_per_gpu": 1000.0}, step=10_000 + j)
        cost[mode] = (time.perf_counter() - t0) / n
    on.close()
    off.close()

    med = {m: statistics.median(v) for m, v in times.items()}
    mean = {m: statistics.fmean(v) for m, v in times.items()}
    cpu_med = {m: statistics.median(v) for m, v in cpu.items()}
    print(f"collector overhead: {args.steps} step pairs, llama3 {args.layers} layers x {args.embed_dim}, "
          f"batch {args.batch_size} x {args.seq_len} tokens, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'mode':<28}{'median step (ms)':>18}{'mean step (ms)':>16}{'median CPU (ms)':>17}{'log_dict (us)':>15}")
    for m, label in (("off", "off (DiskLogger)"), ("on", "on (Collector+DiskLogger)")):
        print(f"{label:<28}{1e3 * med[m]:>18.2f}{1e3 * mean[m]:>16.2f}{1e3 * cpu_med[m]:>17.2f}{1e6 * cost[m]:>15.1f}")
    ratio = statistics.median(pair_ratios)
    print(f"step-time ratio on/off, median over adjacent pairs: {ratio:.4f}  (target <= 1.01)")
    print(f"step-time ratio on/off, ratio of medians:           {med['on'] / med['off']:.4f}")
    print(f"CPU-time ratio on/off, ratio of medians:            {cpu_med['on'] / cpu_med['off']:.4f}")
    print(f"ratio implied by the isolated log_dict cost:        {(med['off'] + cost['on'] - cost['off']) / med['off']:.5f}")
    return 0 if ratio <= 1.01 else 1


if __name__ == "__main__":
    sys.exit(main())
