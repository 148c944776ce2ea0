"""``hlmtune eval``'s forward pass: the fast path vs every position's logits, side by side.

``hlmtune eval`` classifies each DS2 beat from one prompt (context RR tokens + the target
beat's waveform, 213 tokens with the shipped configs) by the next token at its last
position. Its default path (``hlmtune.hlm.evaluate.predict``, ``fast=True``) runs the last
layer's queries and MLP, the final norm and the vocabulary projection at that position only
(``hlmtune.training.fastpath.query_logits``: the others feed only that layer's keys and
values) and, eagerly, RoPE / SwiGLU through their inference paths (``inference_fastpath``);
``fast=False`` is torchtune's forward over every position. This times both on the same
prompts, in adjacent pairs with alternating order, over process CPU time and wall time, and
checks that they give the same predictions and log-probabilities (to fp32 rounding). With
``--compile`` both go through ``torch.compile`` as ``make demo``'s and ``hlmtune cv``'s
evaluations of 10,000 beats or more do (compiled once, in the warm-up pass). Exit status 1
when the fast path is not faster or the predictions differ.

The model is the shipped one's shape with random weights (the time does not depend on the
weights): ``hlm_1m`` (dim 128, 4 layers) by default, the default tokenizer's vocabulary
(303 tokens, padded to 384).

    .venv/bin/python benchmarks/eval_throughput.py [--compile] [--model hlm_1m|hlm_10m] [--prompts 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _run(model, prompts, choices, batch_size: int, fast: bool, compile: bool):
    from hlmtune.hlm.evaluate import predict

    c0, w0 = time.process_time(), time.perf_counter()
    pred, _, lp = predict(model, prompts, choices, batch_size=batch_size, desc=f"fast={fast}",
                          return_logprobs=True, fast=fast, compile=compile)
    return time.process_time() - c0, time.perf_counter() - w0, pred, lp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("hlm_1m", "hlm_10m"), default="hlm_1m",
                    help="HLM size (default hlm_1m, the shipped configs'; hlm_10m is ~6x slower per token)")
    ap.add_argument("--prompts", type=int, default=1024, help="beats classified per timed pass (default 1024)")
    ap.add_argument("--prompt-len", type=int, default=213,
                    help="tokens per prompt (default 213: the shipped classification prompts)")
    ap.add_argument("--batch-size", type=int, default=256, help="prompts per forward pass (default 256, as hlmtune eval)")
    ap.add_argument("--pairs", type=int, default=3, help="measured (fast, full) pass pairs (default 3)")
    ap.add_argument("--compile", action="store_true",
                    help="both paths through torch.compile, as make demo evaluates (default: eager, as hlmtune eval)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's default, as hlmtune eval)")
    args = ap.parse_args()
    if min(args.prompts, args.prompt_len, args.batch_size, args.pairs) < 1 or args.prompt_len < 2:
        ap.error("--prompts, --batch-size and --pairs must be >= 1, --prompt-len >= 2")
    import torch

    from hlmtune.hlm import model as hlm

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = getattr(hlm, args.model)(vocab_size=384).eval()
    g = torch.Generator().manual_seed(1)
    # lengths spread a little around the target, as records' context beats do
    lengths = torch.randint(args.prompt_len - 1, args.prompt_len + 1, (args.prompts,), generator=g)
    prompts = [torch.randint(10, 303, (int(n),), generator=g).tolist() for n in lengths]
    choices = [4, 5, 6, 7]  # four class tokens
    for fast in (True, False):  # warm-up (and, with --compile, the compile) of both paths
        _run(model, prompts[: args.batch_size], choices, args.batch_size, fast, args.compile)
    cpu = {True: [], False: []}
    wall = {True: [], False: []}
    ratios = []
    out = {}
    for k in range(args.pairs):
        got = {}
        for fast in ((True, False) if k % 2 == 0 else (False, True)):
            c, w, pred, lp = _run(model, prompts, choices, args.batch_size, fast, args.compile)
            cpu[fast].append(c)
            wall[fast].append(w)
            got[fast] = c
            out[fast] = (pred, lp)
        ratios.append(got[False] / got[True])
    same = out[True][0] == out[False][0]
    diff = float((out[True][1] - out[False][1]).abs().max())
    n = args.prompts
    print(f"{args.model}: {n} prompts of ~{args.prompt_len} tokens, batches of {args.batch_size}, "
          f"{torch.get_num_threads()} thread(s), {args.pairs} pass pairs, {'compiled' if args.compile else 'eager'}")
    print(f"  predictions identical: {'yes' if same else 'NO'}; class log-probs max |diff| {diff:.2e}")
    for fast, name in ((False, "every position (torchtune's forward)"), (True, "fast path")):
        print(f"  {name}: median {statistics.median(cpu[fast]):.2f} CPU s, {statistics.median(wall[fast]):.2f} wall s "
              f"per pass ({n / statistics.median(wall[fast]):.0f} beats/s)")
    r = statistics.median(ratios)
    print(f"  speedup of the fast path (median over pairs of CPU-time ratios): {r:.2f}x")
    return 0 if same and r > 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
