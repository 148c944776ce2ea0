"""Llama3-8B at the papers' settings on one GPU, with random weights, offline: step time and memory.

The papers this pack serves report Llama3-8B LoRA on alpaca at 0.77 s/it on one H100 and 0.93
s/it on two (batch 2, fp32, torchtune, 4xH100 node), and QAT out of memory below 4 GPUs. Step
time and peak memory do not depend on the weights' values, so this writes a randomly
initialised Llama3-8B (torchtune's architecture: 32 layers x 4096, 32 heads / 8 KV heads, MLP
14336, the real 128,256-token vocabulary) in Hugging Face layout and runs, side by side in one
invocation, for each method x dtype x activation checkpointing:

  pack       hlmtune run lora_finetune_distributed (qat_distributed), one process
  torchtune  tune run lora_finetune_single_device (QAT: tune run --nproc_per_node 1 qat_distributed,
             CUDA only), unmodified

on the shipped 8B configs' settings (``configs/llama3_8b_{lora,qlora,qat}_alpaca.yaml``: LoRA on
q/v/output_proj and the MLP, rank 8, alpha 16, AdamW, chunked cross-entropy), batch 2, one
optimizer step per batch. Rows are random token ids of the alpaca-cleaned rows' lengths (from
``$HLM_DATA/text/alpaca_cleaned.jsonl``: the median longest-of-two row at ~4 characters per
Llama3 token plus the prompt template, prompt tokens unlabelled; 512 tokens without the file),
said so in the output. A run that runs out of memory is reported with the memory it would need
(weights, gradients, AdamW states, the activations one layer saves as the pack's
activation-checkpointing probe measures them, the logits).

On CPU the same code runs scaled down (``--layers 2 --dim 256 ...``: the test suite does) and the
full size is refused with one line.

Usage:
  python benchmarks/llama3_8b_step.py                                   # GPU: lora fp32+bf16, AC off/auto
  python benchmarks/llama3_8b_step.py --methods lora,qlora,qat --dtypes fp32
  python benchmarks/llama3_8b_step.py --layers 2 --dim 256 --intermediate 512 --heads 4 --kv-heads 2 \\
      --vocab 2048 --seq-len 64 --steps 3 --warmup 1                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PY = sys.executable
HLMTUNE = str(Path(PY).with_name("hlmtune"))
TUNE = str(Path(PY).with_name("tune"))
COLLECTOR = "hlmtune.profiling.collector.CollectorLogger"
PAPERS_S_PER_IT = 0.77  # Llama3-8B LoRA, alpaca, batch 2, fp32, 1 H100, torchtune (the papers)
LLAMA3_8B = {"layers": 32, "dim": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256}
# method -> (shipped config, pack recipe, torchtune recipe, torchtune needs torchrun)
METHODS = {
    "lora": ("llama3_8b_lora_alpaca.yaml", "lora_finetune_distributed", "lora_finetune_single_device", False),
    "qlora": ("llama3_8b_qlora_alpaca.yaml", "lora_finetune_distributed", "lora_finetune_single_device", False),
    "qat": ("llama3_8b_qat_alpaca.yaml", "qat_distributed", "qat_distributed", True),
}
CPU_LIMIT = {"layers": 4, "dim": 1024}  # beyond this on CPU: refused (the full model is 32 x 4096)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="lora", help="comma-separated: lora, qlora, qat (default: lora)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="fp32 (the papers'), bf16 (the shipped default)")
    ap.add_argument("--ac", default="off,auto",
                    help="activation checkpointing: off, auto (the pack's: the fewest layers that fit; torchtune "
                         "reads it as every layer), full (default: off,auto)")
    ap.add_argument("--frameworks", default="pack,torchtune", help="pack, torchtune (default: both)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps not timed (default 3)")
    ap.add_argument("--batch-size", type=int, default=2, help="rows per step (default 2, the papers')")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: from the alpaca rows' lengths)")
    for key, v in LLAMA3_8B.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=v, help=f"default {v} (Llama3-8B)")
    ap.add_argument("--data", default=os.path.join(os.environ["HLM_DATA"], "text") if os.environ.get("HLM_DATA") else None,
                    help="folder with alpaca_cleaned.jsonl (row lengths; default $HLM_DATA/text)")
    ap.add_argument("--limit-s", type=float, default=600, help="time limit of each run (default 600)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new temp dir); results.json lands here")
    args = ap.parse_args(argv)
    args.methods = _choices(ap, "--methods", args.methods, METHODS)
    args.dtypes = _choices(ap, "--dtypes", args.dtypes, ("fp32", "bf16"))
    args.ac = _choices(ap, "--ac", args.ac, ("off", "auto", "full"))
    args.frameworks = _choices(ap, "--frameworks", args.frameworks, ("pack", "torchtune"))
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be < --steps {args.steps}")
    return args


def _choices(ap: argparse.ArgumentParser, flag: str, text: str, allowed) -> List[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        ap.error(f"{flag}: unknown {bad}; choose from {', '.join(allowed)}")
    return items


def row_shape(data: Optional[str], batch: int) -> tuple:
    """(tokens per row, labelled share, where the length came from)."""
    path = Path(data or "", "alpaca_cleaned.jsonl")
    if not data or not path.is_file():
        return 512, 0.5, "512 tokens (no alpaca_cleaned.jsonl given); random token ids, 50% labelled"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    template = 30  # tokens of the Alpaca prompt template around instruction and input
    prompt = [(len(r.get("instruction", "")) + len(r.get("input", ""))) / 4 + template for r in rows]
    total = [p + len(r.get("output", "")) / 4 for p, r in zip(prompt, rows)]
    longest = [max(total[i:i + batch]) for i in range(0, len(total) - batch + 1, batch)]  # padded batch length
    seq = int(round(statistics.median(longest)))
    share = 1.0 - statistics.median(p / t for p, t in zip(prompt, total))
    return seq, share, (f"{seq} tokens: the median longest-of-{batch} row of {len(rows)} alpaca-cleaned rows at ~4 "
                        f"characters per Llama3 token + the template; random token ids, {share:.0%} labelled")


def write_assets(args, work: Path, seq: int, share: float) -> Dict[str, Any]:
    """Random-init Llama3 (HF layout) of the chosen size, the tiny tokenizer, the token rows."""
    import numpy as np

    from hlmtune.tiny import write_tiny_assets
    from peers import write_rows

    assets = write_tiny_assets(work / "model", embed_dim=args.dim, num_layers=args.layers,
                               intermediate_dim=args.intermediate, max_seq_len=max(seq, 512), vocab_size=args.vocab,
                               num_heads=args.heads, num_kv_heads=args.kv_heads)
    n = args.batch_size * args.steps
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, size=(n, seq), dtype=np.int64)
    labels = tokens.copy()
    labels[:, : int(round(seq * (1 - share)))] = -100  # the prompt part: not a target
    assets["rows"] = write_rows(work / "rows.npz", {"tokens": tokens, "labels": labels})
    return assets


def write_config(args, work: Path, method: str, dtype: str, ac: str, framework: str, assets: Dict[str, Any]) -> Path:
    """The shipped 8B config with this size's model, the written checkpoint and the token rows."""
    from omegaconf import OmegaConf

    config, *_ = METHODS[method]
    cfg = OmegaConf.load(ROOT / "configs" / config)
    base = OmegaConf.to_container(cfg.model)
    dims = {"vocab_size": args.vocab, "num_layers": args.layers, "num_heads": args.heads, "num_kv_heads": args.kv_heads,
            "embed_dim": args.dim, "intermediate_dim": args.intermediate, "max_seq_len": assets["max_seq_len"]}
    if method == "qat":
        model = {"_component_": "torchtune.models.llama3.llama3", **dims}
    else:  # the shipped LoRA settings on an explicitly sized builder (same as lora_llama3_8b at full size)
        model = {"_component_": "torchtune.models.llama3.lora_llama3", **dims,
                 **{k: v for k, v in base.items() if k != "_component_"}, "quantize_base": method == "qlora"}
    cfg.model = model
    cfg.model_dir = assets["model_dir"]
    cfg.tokenizer.path = assets["tokenizer_path"]
    cfg.tokenizer.special_tokens_path = assets["special_tokens_path"]
    cfg.tokenizer.max_seq_len = assets["max_seq_len"]
    cfg.checkpointer.checkpoint_dir = assets["model_dir"]
    cfg.checkpointer.checkpoint_files = ["model.safetensors"]
    cfg.dataset = {"_component_": "peers.token_rows_dataset", "path": str(assets["rows"])}
    cfg.shuffle = False
    cfg.batch_size = args.batch_size
    cfg.gradient_accumulation_steps = 1
    cfg.epochs = 1
    cfg.max_steps_per_epoch = args.steps
    cfg.dtype = dtype
    cfg.device = "cuda" if _cuda() else "cpu"
    pack_ac = {"off": False, "auto": "auto", "full": True}[ac]
    cfg.enable_activation_checkpointing = pack_ac if framework == "pack" else ac != "off"
    cfg.log_every_n_steps = 1
    cfg.metric_logger = {"_component_": COLLECTOR, "log_dir": "${output_dir}/metrics"}
    if "save_adapter_weights_only" in cfg:
        cfg.save_adapter_weights_only = True
    path = work / f"{method}_{dtype}_{ac}_{framework}.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    return path


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def command(method: str, framework: str, cfg: Path, out: Path) -> Optional[List[str]]:
    """The run's command, or None where that framework has no single-GPU path here."""
    _, pack_recipe, tt_recipe, tt_torchrun = METHODS[method]
    if framework == "pack":
        return [HLMTUNE, "run", pack_recipe, "--config", str(cfg), f"output_dir={out}"]
    if tt_torchrun and not _cuda():
        return None  # torchtune's QAT recipe is distributed only: NCCL, CUDA
    return [TUNE, "run", *(["--nproc_per_node", "1"] if tt_torchrun else []), tt_recipe, "--config", str(cfg),
            f"output_dir={out}"]


def measure(cmd: List[str], out: Path, args) -> Dict[str, Any]:
    """Run one configuration; median step time after warmup and peak memory, or why it did not finish."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]))
    log = out.with_suffix(".log")
    t0 = time.perf_counter()
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.limit_s).returncode
    except subprocess.TimeoutExpired:
        return {"status": f"killed at {args.limit_s:g} s", "wall_s": time.perf_counter() - t0}
    text = log.read_text(errors="replace")
    if rc != 0:
        oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
        return {"status": "out of memory" if oom else f"exit {rc}: {text.strip().splitlines()[-1][-200:] if text.strip() else ''}",
                "oom": oom, "wall_s": time.perf_counter() - t0}
    steps = [json.loads(x) for x in (out / "metrics" / "steps.jsonl").read_text().splitlines() if x.strip()]
    timed = [s["iteration_time_s"] for s in steps if s["step"] > args.warmup and s.get("iteration_time_s") is not None]

    def peak(key: str) -> Optional[float]:
        vals = [s[key] for s in steps if s.get(key) is not None]
        return max(vals) if vals else None

    return {"status": "ok", "s_per_it": statistics.median(timed) if timed else None, "steps": len(steps),
            "peak_alloc_gib": peak("peak_memory_alloc_gib"), "peak_reserved_gib": peak("peak_memory_reserved_gib"),
            "peak_rss_gib": peak("peak_rss_gib"), "loss_first": steps[0].get("loss") if steps else None,
            "wall_s": time.perf_counter() - t0}


def memory_needed_gib(args, method: str, dtype: str, ac: str, seq: int) -> float:
    """What the run would need on one device: weights, gradients and AdamW states of what trains,
    the activations (one layer measured by the pack's probe, times the layers kept), the logits."""
    import torch
    from torchtune.models.llama3 import llama3

    from hlmtune.training.activation_memory import probe_layer

    elem = 4 if dtype == "fp32" else 2
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    device = torch.device("cuda" if _cuda() else "cpu")
    d, f, v, n = args.dim, args.intermediate, args.vocab, args.layers
    hd = d // args.heads
    layer_params = d * (args.heads * hd) * 2 + d * (args.kv_heads * hd) * 2 + 3 * d * f + 2 * d
    total = n * layer_params + 2 * v * d + d
    if method == "qat":
        trainable = total
    else:  # LoRA rank 8 on q, v, output_proj and w1/w2/w3 (the shipped settings)
        r = 8
        trainable = n * r * (3 * (d + args.heads * hd) + 2 * (d + f) + (f + d))
    weights = total * (0.5 if method == "qlora" else elem)  # NF4: 4 bits per base weight
    state = trainable * elem * 3  # gradient + two AdamW moments
    with torch.device(device):
        one = llama3(vocab_size=256, num_layers=1, num_heads=args.heads, num_kv_heads=args.kv_heads, embed_dim=d,
                     intermediate_dim=f, max_seq_len=max(seq, 256)).to(tdtype).layers[0]
    cost = probe_layer(one, embed_dim=d, dtype=tdtype, device=device, max_seq_len=seq)
    per_layer = cost.input_bytes(args.batch_size, seq) if ac == "full" else cost.layer_bytes(args.batch_size, seq)
    logits = args.batch_size * seq * v * 4  # the fp32 logits of the chunked loss
    return (weights + state + n * per_layer + logits) / 1024 ** 3


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    big = args.layers > CPU_LIMIT["layers"] or args.dim > CPU_LIMIT["dim"]
    if big and not _cuda():
        print(f"llama3_8b_step: {args.layers} layers x {args.dim} needs a GPU; on CPU run it scaled down "
              "(e.g. --layers 2 --dim 256 --intermediate 512 --heads 4 --kv-heads 2 --vocab 2048)", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="hlm_llama3_8b_"))
    work.mkdir(parents=True, exist_ok=True)
    seq, share, rows_note = row_shape(args.data, args.batch_size)
    if args.seq_len:
        seq, rows_note = args.seq_len, f"{args.seq_len} tokens (--seq-len); random token ids, {share:.0%} labelled"
    import torch

    device = torch.cuda.get_device_name(0) if _cuda() else "CPU"
    print(f"device: {device}; model: Llama3 {args.layers} layers x {args.dim}, heads {args.heads}/{args.kv_heads}, "
          f"MLP {args.intermediate}, vocabulary {args.vocab}, random init; rows: {rows_note}; batch {args.batch_size}, "
          f"{args.steps} steps ({args.warmup} untimed)", flush=True)
    assets = write_assets(args, work, seq, share)
    results = []
    for method in args.methods:
        for dtype in args.dtypes:
            for ac in args.ac:
                for fw in args.frameworks:
                    out = work / f"{method}_{dtype}_{ac}_{fw}"
                    cmd = command(method, fw, write_config(args, work, method, dtype, ac, fw, assets), out)
                    res = {"status": "not run: torchtune's QAT recipe needs CUDA (NCCL)"} if cmd is None else measure(cmd, out, args)
                    if res.get("oom"):
                        res["needs_gib"] = memory_needed_gib(args, method, dtype, ac, seq)
                    results.append({"method": method, "dtype": dtype, "ac": ac, "framework": fw, **res})
                    print(f"  {method:<5} {dtype} AC {ac:<4} {fw:<9} " + _describe(res), flush=True)
    _print_table(results, device)
    (work / "results.json").write_text(json.dumps({"device": device, "rows": rows_note, "seq_len": seq,
                                                   "model": {k: getattr(args, k) for k in LLAMA3_8B}, "results": results},
                                                  indent=1))
    print(f"results: {work / 'results.json'}")
    return 0


def _describe(r: Dict[str, Any]) -> str:
    if r["status"] != "ok":
        return r["status"] + (f" (needs ~{r['needs_gib']:.1f} GiB)" if r.get("needs_gib") else "")
    mem = (f"peak alloc {r['peak_alloc_gib']:.2f} / reserved {r['peak_reserved_gib']:.2f} GiB" if r.get("peak_alloc_gib")
           else f"peak RSS {r['peak_rss_gib']:.2f} GiB" if r.get("peak_rss_gib") else "")
    return f"{r['s_per_it']:.3f} s/it, {mem}, first loss {r['loss_first']:.4f}"


def _print_table(results: List[Dict[str, Any]], device: str) -> None:
    print(f"\n{device}: median s/it (batch 2, one optimizer step each); papers: {PAPERS_S_PER_IT} s/it "
          "(Llama3-8B LoRA, alpaca, fp32, one H100, torchtune)")
    print(f"{'method':<6} {'dtype':<5} {'AC':<5} {'pack s/it':>10} {'torchtune s/it':>15} {'pack/torchtune speed':>21}")
    keys = sorted({(r["method"], r["dtype"], r["ac"]) for r in results}, key=str)
    for key in keys:
        by = {r["framework"]: r for r in results if (r["method"], r["dtype"], r["ac"]) == key}
        cells = []
        for fw in ("pack", "torchtune"):
            r = by.get(fw)
            cells.append("-" if r is None else f"{r['s_per_it']:.3f}" if r["status"] == "ok" else r["status"][:15])
        ratio = "-"
        if all(by.get(fw, {}).get("status") == "ok" for fw in ("pack", "torchtune")):
            ratio = f"{by['torchtune']['s_per_it'] / by['pack']['s_per_it']:.2f}x"
        print(f"{key[0]:<6} {key[1]:<5} {key[2]:<5} {cells[0]:>10} {cells[1]:>15} {ratio:>21}")


if __name__ == "__main__":
    sys.exit(main())
