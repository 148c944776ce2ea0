"""The pack vs the recipes users would pick instead, side by side in one invocation.

Frameworks, all on the same random-init Llama3 (written once in HF layout), the same token
rows (packed, fixed length, no padding), batch, sequence length, precision (fp32), threads and
LoRA settings, at each thread count of --threads in one invocation (ratios per thread count):
  pack       hlmtune run --nproc_per_node 1 lora_finetune_distributed   (lora_dpo_distributed)
  torchtune  tune run lora_finetune_single_device, unmodified           (lora_dpo_single_device)
  trl        TRL SFTTrainer + PEFT LoRA                                  (DPOTrainer)
             optional: pip install 'hlmtune[bench]'; skipped with a message when absent
With --ecg: pack vs torchtune's single-device recipe on configs/ecg_lora.yaml (the HLM-1M
heart language model with random weights, on token shards of a few MIT-BIH records, or of
synthetic records without $HLM_DATA).

Checks the first-step loss is identical across frameworks (relative tolerance --loss-rtol),
then prints per framework: tokens/s (target tokens of the timed steps / their wall time),
median step time (wall time between consecutive step ends, steps after --warmup), the same
two over the process's CPU time (collector's process_cpu_s: with one thread per run this is
the work done, much steadier than wall time while other jobs load the host), peak RSS
(the larger of os.wait4's and the collector's since-start peak), and pack / peer ratios. Repeats are interleaved (rotating
order), so a shared host's load drifts hit every framework alike; the median repeat counts.

Rows come from the real alpaca-cleaned sample when $HLM_DATA/text (or --data) has it, else
from uniform random tokens (--synthetic forces that).

--pack-set KEY=VALUE adds a config override for the pack only (e.g. compile=True); the first
step (compile time) is then reported separately. --pack-defaults --peer-defaults is the
"shipped defaults" comparison: every framework at the speed/memory knobs (activation
checkpointing, compile, fused optimizer) of the Llama3-8B config it ships for the recipe
(the pack: configs/llama3_8b_*.yaml; torchtune: its single-device config, read from the
installed package; TRL: activation checkpointing on), same model, data, batch and fp32.

Usage:
  python benchmarks/peer_throughput.py                       # LoRA, small model, ~3 min on 2 cores
  python benchmarks/peer_throughput.py --recipe dpo
  python benchmarks/peer_throughput.py --recipe qlora        # pack and torchtune (TRL: CUDA only)
  python benchmarks/peer_throughput.py --ecg
  python benchmarks/peer_throughput.py --pack-defaults --peer-defaults   # shipped defaults
  python benchmarks/peer_throughput.py --layers 8 --dim 512 --intermediate 1536 --seq-len 512 --steps 20
  python benchmarks/peer_throughput.py --threads 1,2,all --all-labelled --vocab-size 8000   # issue 45's shape
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent  # benchmarks/: peers.py lives here, not in the installed package
sys.path.insert(0, str(ROOT))
PY = sys.executable
HLMTUNE = str(Path(PY).with_name("hlmtune"))
TUNE = str(Path(PY).with_name("tune"))
COLLECTOR = "hlmtune.profiling.collector.CollectorLogger"
# DS1 records with all four AAMI classes in their first minutes (as the HLM tests use).
ECG_RECORDS = ["101", "106", "118", "119", "208"]

RECIPES = {  # --recipe: (pack recipe, torchtune recipe, TRL trainer or None, base config)
    "lora": ("lora_finetune_distributed", "lora_finetune_single_device", "sft", "tiny_lora.yaml"),
    "qlora": ("lora_finetune_distributed", "lora_finetune_single_device", None, "tiny_lora.yaml"),
    "dpo": ("lora_dpo_distributed", "lora_dpo_single_device", "dpo", "tiny_lora_dpo.yaml"),
}
TRL_ABSENT_WHY = {
    "qlora": "TRL's QLoRA needs bitsandbytes 4-bit kernels, which run on CUDA only: not measured on CPU",
}


def trl_available() -> Optional[str]:
    """None when TRL and PEFT import, else the reason they do not."""
    try:
        import peft  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        return f"TRL/PEFT not installed ({e}); install the extra: pip install 'hlmtune[bench]'"
    return None


def read_steps(path: Path) -> List[Dict[str, float]]:
    """Per-step rows of a collector steps.jsonl or a TRL run's JSONL, with ``wall_s`` (time
    between consecutive step ends; None for the first step) and ``loss``."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("steps_elapsed", 1)]
    out = []
    prev = prev_cpu = None
    for r in rows:
        if "elapsed_s" in r:  # collector: wall clock since start at each log_dict
            wall = None if prev is None else r["elapsed_s"] - prev
            prev = r["elapsed_s"]
        else:  # TRL runner: already the time between step ends (first: from first step start)
            wall = r["iteration_time_s"] if out else None
        cpu = r.get("process_cpu_s")
        out.append({"step": r["step"], "loss": r.get("loss"), "wall_s": wall,
                    "cpu_s": None if cpu is None or prev_cpu is None else cpu - prev_cpu,
                    "first_s": r.get("iteration_time_s") if not out else None})
        prev_cpu = cpu
    return out


def summarize(steps: List[Dict[str, float]], warmup: int, tokens_per_step: float, rss: float) -> Dict[str, float]:
    """Timed steps (after ``warmup``): median step time, tokens/s; plus first loss and step."""
    timed = [s["wall_s"] for s in steps if s["step"] > warmup and s["wall_s"] is not None]
    if not timed:
        raise RuntimeError(f"no timed steps after warmup {warmup} (steps: {len(steps)})")
    cpu = [s["cpu_s"] for s in steps if s["step"] > warmup and s["cpu_s"] is not None]
    return {"median_s": statistics.median(timed), "tok_s": tokens_per_step * len(timed) / sum(timed),
            "cpu_median_s": statistics.median(cpu) if cpu else float("nan"),
            "tok_cpu_s": tokens_per_step * len(cpu) / sum(cpu) if cpu else float("nan"),
            "rss": rss, "loss1": steps[0]["loss"], "first_s": steps[0]["first_s"], "n": len(timed),
            "losses": [s["loss"] for s in steps]}


def build_rows(args, work: Path, assets: Dict[str, object]) -> Path:
    """Write the shared row file (real alpaca rows when available, else synthetic)."""
    from peers import dpo_rows_from_sft, sft_rows_from_text, synthetic_sft_rows, write_rows

    n = args.batch_size * args.steps + 1
    data_file = Path(args.data or "", "alpaca_cleaned.jsonl")
    if not args.synthetic and args.data and data_file.is_file():
        from torchtune.models.llama3 import llama3_tokenizer

        tok = llama3_tokenizer(path=str(assets["tokenizer_path"]), special_tokens_path=str(assets["special_tokens_path"]),
                               max_seq_len=args.seq_len)
        sft = sft_rows_from_text(tok, str(data_file), n, args.seq_len, train_on_input=args.all_labelled)
        source = (f"real alpaca rows ({data_file}), packed, "
                  + ("every position labelled" if args.all_labelled else "prompt tokens unlabelled"))
    else:
        sft = synthetic_sft_rows(n, args.seq_len, 512, seed=0)  # BPE ids only, no special tokens
        source = "synthetic uniform tokens, every position labelled"
    rows = dpo_rows_from_sft(sft, args.seq_len // 4) if args.recipe == "dpo" else {k: v[:-1] for k, v in sft.items()}
    print(f"data: {source}", flush=True)
    return write_rows(work / "rows.npz", rows)


def tokens_per_step(rows_path: Path, batch: int, steps: int, dpo: bool) -> float:
    """Tokens one step processes: target tokens (SFT, after the shift) or all tokens (DPO)."""
    from peers import IGNORE_INDEX, read_rows

    a = read_rows(rows_path)
    n = batch * steps
    if dpo:
        return 2.0 * a["chosen_tokens"][:n].size / steps
    return float((a["labels"][:n, 1:] != IGNORE_INDEX).sum()) / steps


def write_config(args, work: Path, assets: Dict[str, object], rows: Path) -> Path:
    """One YAML both the pack and torchtune run (the pack's keys are ignored by torchtune)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "configs" / RECIPES[args.recipe][3])
    cfg.model_dir = str(assets["model_dir"])
    cfg.data_dir = str(work)
    m = cfg.model
    m.lora_attn_modules = ["q_proj", "v_proj"]
    m.apply_lora_to_mlp = False
    m.lora_rank, m.lora_alpha = args.lora_rank, 2 * args.lora_rank
    m.vocab_size, m.num_layers, m.embed_dim = assets["vocab_size"], args.layers, args.dim
    m.num_heads, m.num_kv_heads = assets["num_heads"], assets["num_kv_heads"]
    m.intermediate_dim, m.max_seq_len = assets["intermediate_dim"], args.seq_len
    if args.recipe == "qlora":
        m.quantize_base = True
    cfg.tokenizer.max_seq_len = args.seq_len
    cfg.dataset = {"_component_": "peers.token_rows_dataset", "path": str(rows)}  # benchmarks/ is on PYTHONPATH
    cfg.shuffle = False
    cfg.batch_size = args.batch_size
    cfg.epochs = 1
    cfg.max_steps_per_epoch = args.steps
    cfg.optimizer.lr = args.lr
    cfg.save_adapter_weights_only = True
    cfg.log_every_n_steps = 1
    cfg.metric_logger = {"_component_": COLLECTOR, "log_dir": "${output_dir}/metrics"}
    path = work / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    return path


def ecg_setup(args, work: Path) -> List[str]:
    """Token shards of a few records + random HLM-1M weights; overrides for configs/ecg_lora.yaml."""
    import torch

    from hlmtune.files import atomic_torch_save, atomic_write_text
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams
    from hlmtune.hlm.model import hlm_1m

    mitdb = Path(args.data or "").parent / "mitdb" if args.data else None
    if mitdb is not None and (mitdb / "100.hea").exists() and not args.synthetic:
        db, records, options = mitdb, ECG_RECORDS[: args.ecg_records], RecordOptions(sampto=360 * args.ecg_seconds)
        print(f"data: MIT-BIH records {records}, first {args.ecg_seconds} s each", flush=True)
    else:
        from hlmtune.hlm.pipeline import synthetic_database

        db = synthetic_database(work / "synth", n_records=args.ecg_records, duration_s=args.ecg_seconds)
        records, options = json.loads((db / "splits.json").read_text())["DS1"], RecordOptions()
        print(f"data: synthetic ECG records {records}", flush=True)
    shards = work / "tokens"
    s = tokenize_directory(db, shards, params=TokenizerParams(), options=options, records=records, workers=1, progress=False)
    if not s.ok:
        sys.exit(f"tokenizing ECG records failed:\n{s.format()}")
    split = work / "splits.json"  # the last record stands in as the (unused) DS2 test record
    atomic_write_text(split, json.dumps({"DS1": records[:-1], "DS2": records[-1:]}))
    torch.manual_seed(0)
    model = hlm_1m(manifest_path=str(shards))
    atomic_torch_save(model.state_dict(), work / "pretrain" / "epoch_0" / "model.pt")
    return [f"shards_dir={shards}", f"split_file={split}", f"pretrain_dir={work / 'pretrain'}",
            f"max_steps_per_epoch={args.steps}", f"dataset.num_examples={args.batch_size_ecg * args.steps}",
            f"batch_size={args.batch_size_ecg}", "shuffle=False", "log_every_n_steps=1",
            "save_adapter_weights_only=True", f"metric_logger._component_={COLLECTOR}",
            "metric_logger.log_dir=${output_dir}/metrics"]


def shipped_defaults(args) -> tuple:
    """Overrides (``key=value``) for the pack and for torchtune under --pack-defaults / --peer-defaults."""
    from peers import SHIPPED_CONFIGS, shipped_knobs, torchtune_config_file

    if args.ecg:
        return [], []
    pack_cfg, tt_cfg = SHIPPED_CONFIGS[args.recipe]

    def as_overrides(knobs: Dict[str, object]) -> List[str]:
        return [f"{k}={v}" for k, v in knobs.items()]

    pack = as_overrides(shipped_knobs(ROOT / "configs" / pack_cfg)) if args.pack_defaults else []
    tt = as_overrides(shipped_knobs(torchtune_config_file(tt_cfg))) if args.peer_defaults else []
    return pack, tt


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="lora", help="lora (default), qlora or dpo")
    ap.add_argument("--ecg", action="store_true", help="pack vs torchtune single-device on configs/ecg_lora.yaml (HLM-1M)")
    ap.add_argument("--data", default=os.path.join(os.environ["HLM_DATA"], "text") if os.environ.get("HLM_DATA") else None,
                    help="folder with alpaca_cleaned.jsonl (default: $HLM_DATA/text; --ecg reads ../mitdb next to it)")
    ap.add_argument("--synthetic", action="store_true", help="random tokens (synthetic ECG records with --ecg) even when data exists")
    ap.add_argument("--frameworks", default="pack,torchtune,trl",
                    help="comma-separated subset (default: pack,torchtune,trl); pack-ranks: the pack as N ranks of one "
                         "thread each at N threads (same global batch), beside the pack's one process of N threads")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per run (default 12)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps not timed (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median counts (default 3)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    ap.add_argument("--dim", type=int, default=256, help="model width, multiple of 64 (default 256)")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3 x dim)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="model vocabulary (embedding and output rows; default: the tiny tokenizer's 768 ids). "
                         "Larger pads the vocabulary: the output layer and loss do that vocabulary's work, the "
                         "rows keep the tokenizer's ids (e.g. 8000 for an 8k-token BPE model's cost)")
    ap.add_argument("--all-labelled", action="store_true",
                    help="every position of the packed alpaca rows is a target (train_on_input); default: prompt "
                         "tokens unlabelled, as the shipped configs train")
    ap.add_argument("--batch-size", type=int, default=4, help="rows per step (default 4)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    ap.add_argument("--lora-rank", type=int, default=8, help="LoRA rank on q_proj and v_proj; alpha = 2 x rank (default 8)")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    ap.add_argument("--threads", default="all", type=_thread_counts,
                    help="intra-op threads of every run (OMP_NUM_THREADS), a comma-separated list measured in one "
                         "invocation, 'all' = the host's cores (default: all). e.g. --threads 1,2,all; the ratios are "
                         "printed per thread count. Wall time counts only on an idle host: CPU time stays the work "
                         "done at 1 thread, not at more")
    ap.add_argument("--loss-rtol", type=float, default=1e-4, help="first-step loss tolerance, relative (default 1e-4)")
    ap.add_argument("--pack-set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for the pack only (repeatable), e.g. compile=True")
    ap.add_argument("--peer-defaults", action="store_true",
                    help="peers at their own shipped defaults: torchtune at the speed/memory knobs of its Llama3-8B "
                         "single-device config for the recipe (activation checkpointing, compile, fused optimizer: "
                         "read from the installed torchtune), TRL with activation checkpointing (its default); "
                         "model, data, batch and precision (fp32) stay the same")
    ap.add_argument("--pack-defaults", action="store_true",
                    help="the pack at the same knobs of its own Llama3-8B config for the recipe (configs/llama3_8b_*)")
    ap.add_argument("--batch-size-ecg", type=int, default=32, help="--ecg: batch size (default 32, as configs/ecg_lora.yaml)")
    ap.add_argument("--ecg-records", type=int, default=4, help="--ecg: records to tokenize, the last one held out as DS2 (default 4)")
    ap.add_argument("--ecg-seconds", type=int, default=120, help="--ecg: seconds per record (default 120)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new temp dir)")
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be < --steps {args.steps}")
    args.wanted = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in args.wanted if f not in ("pack", "pack-ranks", "torchtune", "trl")]
    if bad:
        ap.error(f"--frameworks: unknown {bad}; choose from pack, pack-ranks, torchtune, trl")
    if "pack-ranks" in args.wanted and any(args.batch_size % t for t in args.threads):
        ap.error(f"--frameworks pack-ranks: --batch-size {args.batch_size} must divide over every thread count {args.threads}")
    return args


def _thread_counts(text: str) -> List[int]:
    """``"1,2,all"`` -> ``[1, 2, <cores>]`` (sorted, each once)."""
    cores = os.cpu_count() or 1
    out = []
    for part in text.split(","):
        part = part.strip()
        n = cores if part == "all" else int(part) if part.isdigit() else 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: thread counts are positive integers or 'all'")
        out.append(n)
    return sorted(set(out))


def setup_runs(args, work: Path) -> tuple:
    """(commands by framework, tokens per step or None, the setup's one-line description)."""
    wanted = list(args.wanted)
    pack_recipe, tt_recipe, trl_kind, _ = RECIPES[args.recipe]
    runs: Dict[str, List[str]] = {}
    trl_cmd: Optional[List[str]] = None
    if args.ecg:
        pack_recipe, tt_recipe = "lora_finetune_distributed", "lora_finetune_single_device"
        overrides = ecg_setup(args, work)
        cfg_path = str(ROOT / "configs" / "ecg_lora.yaml")
        tps = None  # from the collector rows (examples vary in length)
        what = f"HLM-1M (configs/ecg_lora.yaml), batch {args.batch_size_ecg}, fp32"
        wanted = [f for f in wanted if f != "trl"]
        print("trl: not run with --ecg (the HLM is a torchtune model with its own tokenizer; the issue compares "
              "pack vs torchtune here)", flush=True)
    else:
        from hlmtune.tiny import write_tiny_assets

        inter = args.intermediate or 3 * args.dim
        assets = write_tiny_assets(work / "model", embed_dim=args.dim, num_layers=args.layers, intermediate_dim=inter,
                                   max_seq_len=args.seq_len, vocab_size=args.vocab_size)
        rows = build_rows(args, work, assets)
        cfg_path = str(write_config(args, work, assets, rows))
        overrides = []
        tps = tokens_per_step(rows, args.batch_size, args.steps, args.recipe == "dpo")
        from torchtune.models.llama3 import llama3

        n_params = sum(p.numel() for p in llama3(vocab_size=assets["vocab_size"], num_layers=args.layers,
                                                  num_heads=assets["num_heads"], num_kv_heads=assets["num_kv_heads"],
                                                  embed_dim=args.dim, max_seq_len=args.seq_len,
                                                  intermediate_dim=inter).parameters())
        vocab = (f"vocabulary {assets['vocab_size']}" + (f" (padded; tokenizer ids {assets['tokenizer_vocab_size']})"
                                                         if assets["vocab_size"] != assets["tokenizer_vocab_size"] else ""))
        what = (f"Llama3 {args.layers} layers x {args.dim} ({n_params / 1e6:.1f}M params, {vocab}), {args.recipe}, "
                f"LoRA r{args.lora_rank} q/v, batch {args.batch_size} x {args.seq_len}, "
                f"{tps:.0f} target tokens/step, fp32")
        if "trl" in wanted:
            why = TRL_ABSENT_WHY.get(args.recipe) or trl_available()
            if why:
                print(f"trl: skipped: {why}", flush=True)
                wanted.remove("trl")
            else:
                trl_cmd = [PY, str(HERE / "peers.py"), "trl", "--kind", trl_kind, "--model-dir", str(assets["model_dir"]),
                           "--rows", str(rows), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                           "--lr", str(args.lr), "--lora-rank", str(args.lora_rank),
                           "--lora-alpha", str(2 * args.lora_rank), "--targets", "q_proj,v_proj"]
                if args.peer_defaults:
                    trl_cmd.append("--activation-checkpointing")
    pack_knobs, tt_knobs = shipped_defaults(args)
    if "pack" in wanted:
        runs["pack"] = [HLMTUNE, "run", "--nproc_per_node", "1", pack_recipe, "--config", cfg_path, *overrides,
                        *pack_knobs, *args.pack_set]
    if "pack-ranks" in wanted:  # --nproc_per_node and the per-rank batch are set per thread count (measure)
        runs["pack-ranks"] = [HLMTUNE, "run", "--nproc_per_node", "N", pack_recipe, "--config", cfg_path, *overrides,
                              *pack_knobs, *args.pack_set]
    if "torchtune" in wanted:
        runs["torchtune"] = [TUNE, "run", tt_recipe, "--config", cfg_path, *overrides, *tt_knobs]
    if trl_cmd is not None:
        runs["trl"] = trl_cmd
    what += (f"; {args.steps} steps, first {args.warmup} untimed, {args.repeats} interleaved repeats"
             + (f"; pack overrides: {' '.join(args.pack_set)}" if args.pack_set else "")
             + ("; peers at their shipped defaults (TRL: activation checkpointing; torchtune: "
                + (" ".join(tt_knobs) or "none") + ")" if args.peer_defaults else "")
             + ("; pack at its shipped defaults (" + (" ".join(pack_knobs) or "none") + ")" if args.pack_defaults else ""))
    return runs, tps, what


def measure(runs: Dict[str, List[str]], args, work: Path, threads: int, tps: Optional[float]) -> tuple:
    """Interleaved repeats of every framework at ``threads`` intra-op threads: (results by framework, tokens/step)."""
    from peers import peak_rss_gib_of

    # benchmarks/ on the path: the pack's ranks import the peers' row dataset (peers.py) from here
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]),
               TOKENIZERS_PARALLELISM="false")
    names = [n for n in runs if not (n == "pack-ranks" and threads == 1)]  # 1 rank of 1 thread: the pack itself
    results: Dict[str, List[Dict[str, float]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            tag = f"{name}_t{threads}_rep{rep}"
            out = work / tag
            run_env = env
            if name == "trl":
                cmd, steps_file = runs[name] + ["--out", str(out / "steps.jsonl")], out / "steps.jsonl"
                out.mkdir(parents=True, exist_ok=True)
            else:
                cmd, steps_file = runs[name] + [f"output_dir={out}"], out / "metrics" / "steps.jsonl"
            if name == "pack-ranks":  # N ranks x 1 thread, the same global batch
                cmd = [str(threads) if c == "N" else c for c in cmd] + [f"batch_size={args.batch_size // threads}"]
                run_env = dict(env, OMP_NUM_THREADS="1")
            res = peak_rss_gib_of(cmd, run_env, log_path=work / f"{tag}.log")
            if res["returncode"] != 0:
                tail = (work / f"{tag}.log").read_text(errors="replace")[-3000:]
                sys.exit(f"FAILED ({name}, exit {res['returncode']}): {' '.join(cmd)}\n{tail}")
            steps = read_steps(steps_file)
            if tps is None:  # ECG: examples vary in length; the first run's own count (the pack's) for all
                tps = _collector_tokens(steps_file, args.warmup)
            s = summarize(steps, args.warmup, tps, max(res["peak_rss_gib"], _collector_peak_rss(steps_file)))
            results[name].append(s)
            print(f"  {threads} thread(s), repeat {rep + 1}/{args.repeats} {name:<10} median {s['median_s']:.3f} s/step "
                  f"({s['cpu_median_s']:.3f} CPU s)  "
                  f"{s['tok_s']:8.1f} tok/s  RSS {s['rss']:.2f} GiB  first-step loss {s['loss1']:.6f}", flush=True)
    return results, tps


def report(results: Dict[str, List[Dict[str, float]]], args, what: str, threads: int) -> tuple:
    """Print one thread count's table, loss checks and pack / peer ratios; returns (medians, losses agree)."""
    names = list(results)
    keys = ("median_s", "tok_s", "cpu_median_s", "tok_cpu_s", "rss")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in results.items()}
    print(f"\n{what}; {threads} thread(s)")
    print(f"{'framework':<11} {'tok/s':>9} {'median s/step':>14} {'tok/CPU-s':>10} {'CPU s/step':>11} "
          f"{'peak RSS GiB':>13} {'first-step loss':>16}")
    for n in names:
        first = results[n][0]
        extra = ""
        if any(s.startswith("compile") for s in args.pack_set) and n == "pack" and first["first_s"]:
            extra = f"   (first step incl. compile: {statistics.median(r['first_s'] for r in results[n]):.1f} s)"
        print(f"{n:<11} {med[n]['tok_s']:>9.1f} {med[n]['median_s']:>14.3f} {med[n]['tok_cpu_s']:>10.1f} "
              f"{med[n]['cpu_median_s']:>11.3f} {med[n]['rss']:>13.2f} {first['loss1']:>16.6f}{extra}")
    ok = True
    ref = results[names[0]][0]["loss1"]
    for n in names[1:]:
        l1 = results[n][0]["loss1"]
        same = l1 is not None and abs(l1 - ref) <= args.loss_rtol * max(1.0, abs(ref))
        ok &= same
        print(f"first-step loss {n} vs {names[0]}: {l1:.6f} vs {ref:.6f}: {'identical within' if same else 'DIFFERS beyond'} "
              f"rtol {args.loss_rtol}")
    for n in names[1:]:  # the whole curve, not only step 1: implementation choices must keep it
        a, b = results[names[0]][0]["losses"], results[n][0]["losses"]
        pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
        if pairs:
            dev = max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)
            print(f"loss curve {names[0]} vs {n} ({len(pairs)} steps, first repeat): max relative difference {dev:.2e}")
    if args.recipe == "dpo" and not args.ecg:
        print("note: DPO's first-step loss is ln 2 in every framework (LoRA B = 0: policy = reference); "
              "it checks the DPO loss and the reference path, the SFT runs check the model and the tokens")
    if "pack" in med:
        for n in [n for n in names if n != "pack"]:
            print(f"pack / {n}: speed {med['pack']['tok_s'] / med[n]['tok_s']:.3f}x (wall), "
                  f"{med['pack']['tok_cpu_s'] / med[n]['tok_cpu_s']:.3f}x (CPU time), "
                  f"peak RSS {med['pack']['rss'] / med[n]['rss']:.3f}x")
        peers = [n for n in names if n not in ("pack", "pack-ranks")]
        if peers:
            fastest = max(peers, key=lambda n: med[n]["tok_s"])
            fastest_cpu = max(peers, key=lambda n: med[n]["tok_cpu_s"])
            smallest = min(peers, key=lambda n: med[n]["rss"])
            print(f"pack vs faster peer: {med['pack']['tok_s'] / med[fastest]['tok_s']:.3f}x wall ({fastest}), "
                  f"{med['pack']['tok_cpu_s'] / med[fastest_cpu]['tok_cpu_s']:.3f}x CPU time ({fastest_cpu})   "
                  f"pack RSS vs smaller peer ({smallest}): {med['pack']['rss'] / med[smallest]['rss']:.3f}x")
    return med, ok


def thread_table(meds: Dict[int, Dict[str, Dict[str, float]]]) -> List[str]:
    """Lines of the per-thread-count summary: wall tokens/s of each framework, pack / peer, scaling."""
    order = ("pack", "pack-ranks", "torchtune", "trl")
    names = sorted({n for m in meds.values() for n in m}, key=order.index)  # every framework measured
    counts = sorted(meds)

    def tok(t: int, n: str) -> Optional[float]:
        return meds[t][n]["tok_s"] if n in meds[t] else None

    def cell(v: Optional[float], width: int, suffix: str = "") -> str:
        return f"{'-':>{width}}" if v is None else f"{v:>{width - len(suffix)}.{3 if suffix else 1}f}{suffix}"

    others = [n for n in names if n != "pack"] if "pack" in names else []
    lines = ["", "wall-time tokens/s (median repeat) by intra-op threads (pack-ranks: that many ranks of 1 thread):",
             f"{'threads':>7} " + " ".join(f"{n:>10}" for n in names) + "".join(f" {'pack/' + n:>16}" for n in others)]
    for t in counts:
        row = f"{t:>7} " + " ".join(cell(tok(t, n), 10) for n in names)
        row += "".join(" " + cell(tok(t, "pack") / tok(t, n) if tok(t, n) else None, 16, "x") for n in others)
        lines.append(row)
    if len(counts) > 1:
        lo, hi = counts[0], counts[-1]
        lines.append(f"scaling {hi} / {lo} thread(s): " + ", ".join(
            f"{n} {tok(hi, n) / tok(lo, n):.2f}x" for n in names if tok(hi, n) and tok(lo, n)))
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="hlm_peers_"))
    work.mkdir(parents=True, exist_ok=True)
    runs, tps, what = setup_runs(args, work)
    print(f"setup: {what}; thread counts {args.threads} (host: {os.cpu_count()} cores)", flush=True)
    print(f"load: {os.getloadavg()[0]:.2f} (1-min average) at start; work dir {work}", flush=True)
    meds: Dict[int, Dict[str, Dict[str, float]]] = {}
    ok = True
    for threads in args.threads:
        results, tps = measure(runs, args, work, threads, tps)
        meds[threads], agree = report(results, args, what, threads)
        ok &= agree
    print(f"\nload: {os.getloadavg()[0]:.2f} (1-min average) at end")
    print("\n".join(thread_table(meds)))
    if not ok:
        sys.exit("first-step losses differ: the frameworks did not train the same model on the same tokens")


def _collector_peak_rss(steps_file: Path) -> float:
    """Peak RSS since process start from a collector steps.jsonl (0.0 for TRL's JSONL).

    The collector and the pack reset the kernel's RSS high-water mark at every step (to get
    per-step peaks), which also lowers what ``wait4`` reports at exit; their since-start
    peaks fold every reading in before each reset.
    """
    rows = [json.loads(x) for x in steps_file.read_text().splitlines() if x.strip()]
    return max([r.get("peak_rss_since_start_gib") or 0.0 for r in rows] + [0.0])


def _collector_tokens(steps_file: Path, warmup: int) -> float:
    """Mean target tokens per timed step from a collector steps.jsonl (the pack's ``tokens``,
    or torchtune's tokens/s x its own step time)."""
    rows = [json.loads(x) for x in steps_file.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r["step"] > warmup]
    vals = []
    for r in rows:
        if r.get("tokens") is not None:
            vals.append(r["tokens"])
        elif r.get("tokens_per_second_per_gpu") and r.get("iteration_time_s"):
            vals.append(r["tokens_per_second_per_gpu"] * r["iteration_time_s"])
    return statistics.mean(vals) if vals else float("nan")


if __name__ == "__main__":
    main()
