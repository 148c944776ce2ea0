"""``hlmtune scaling-demo``: the whole loop of the pack in a minute on a laptop-class CPU.

1. write a tiny 2-layer Llama3 in the ``tune download`` layout (tokenizer + HF checkpoint);
2. LoRA fine-tune it on the real alpaca-cleaned sample with the pack's
   ``lora_finetune_distributed`` at 1 rank and at 2 ranks (same global batch, so both runs do
   the same work; one thread per rank), each recorded by the profiling collector;
3. ``hlmtune collect`` the two runs into a scaling table (speedup, efficiency, overhead) with
   plots.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

COLLECTOR = "hlmtune.profiling.collector.CollectorLogger"


def run_demo(*, out: Path, data: Optional[str], steps: int, max_ranks: int) -> int:
    """Run the demo.

    Args:
        out (Path): output folder (model, runs, report).
        data (Optional[str]): alpaca-cleaned JSONL; default ``$HLM_DATA/text/alpaca_cleaned.jsonl``.
        steps (int): optimizer steps per run.
        max_ranks (int): largest world size.

    Returns:
        int: exit status (0 when every run and the report succeeded).
    """
    if data is None:
        root = os.environ.get("HLM_DATA")
        if not root:
            print("hlmtune scaling-demo: give --data <alpaca_cleaned.jsonl> or set HLM_DATA (folder with text/alpaca_cleaned.jsonl)", file=sys.stderr)
            return 2
        data = os.path.join(root, "text", "alpaca_cleaned.jsonl")
    data_path = Path(data).resolve()
    if not data_path.is_file():
        print(f"hlmtune scaling-demo: {data_path} does not exist", file=sys.stderr)
        return 2
    from hlmtune.files import OutputPathError, ensure_dir
    from hlmtune.tiny import write_tiny_assets

    try:
        out = ensure_dir(out, "--out").resolve()
    except OutputPathError as e:
        print(f"hlmtune scaling-demo: {e}", file=sys.stderr)
        return 2
    model_dir = out / "tiny-llama3"
    print(f"[demo] writing tiny Llama3 (tokenizer + HF checkpoint) to {model_dir}", flush=True)
    # Big enough that compute, not per-step overhead, dominates a CPU step (~11M params), so the
    # 1 vs 2 rank comparison shows scaling; still about a minute in all.
    dims = {"embed_dim": 384, "num_layers": 4, "intermediate_dim": 1152, "max_seq_len": 512}
    assets = write_tiny_assets(model_dir, **dims)
    hlmtune = str(Path(sys.executable).with_name("hlmtune"))
    global_batch = 4
    run_dirs = []
    for n in range(1, max_ranks + 1):
        if global_batch % n:
            continue
        run = out / "runs" / f"lora_ws{n}"
        # One thread per rank at every world size: one core per rank is the CPU analog of one
        # GPU per rank, so 1 vs 2 ranks compares like for like.
        cmd = [hlmtune, "run", "--nproc_per_node", str(n),
            "lora_finetune_distributed", "--config", "tiny_lora",
            f"model_dir={model_dir}", f"data_dir={data_path.parent}",
            f"dataset.data_files={data_path}", f"output_dir={run}",
            f"max_steps_per_epoch={steps}", f"batch_size={global_batch // n}",
            f"model.embed_dim={dims['embed_dim']}", f"model.num_layers={dims['num_layers']}",
            f"model.intermediate_dim={dims['intermediate_dim']}", f"model.num_heads={assets['num_heads']}",
            f"model.num_kv_heads={assets['num_kv_heads']}", "dataset.packed=True", "tokenizer.max_seq_len=512",
            f"metric_logger._component_={COLLECTOR}", f"metric_logger.log_dir={run}/metrics",
            "metric_logger.wrapped._component_=torchtune.training.metric_logging.DiskLogger",
            f"metric_logger.wrapped.log_dir={run}/logs",
        ]
        print(f"[demo] LoRA on {n} rank{'s' if n > 1 else ''}: {steps} steps, global batch {global_batch}", flush=True)
        # torchrun sets OMP_NUM_THREADS=1 only for more than one rank: pin it for every run.
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            print(f"[demo] run on {n} ranks failed (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode or 1
        run_dirs.append(str(run / "metrics"))
    report = out / "report"
    print(f"[demo] collecting {len(run_dirs)} runs into {report}", flush=True)
    proc = subprocess.run([hlmtune, "collect", *run_dirs, "--out", str(report)])
    if proc.returncode != 0:
        return proc.returncode
    table = report / "table.md"
    if table.exists():
        print("\n" + table.read_text())
    print(f"[demo] done: runs in {out / 'runs'}, table and plots in {report}")
    return 0
