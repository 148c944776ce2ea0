"""``hlmtune gpu-check`` (``make gpu-check``): every CUDA path of the pack, run and reported in minutes.

The day a GPU is lent it may be for minutes and without internet, so this command is ready
before that: tiny models written locally (a 2-layer Llama3 from ``hlmtune.tiny``, ``hlm_1m``
on a few ECG records), the shared text and MIT-BIH data when ``HLM_DATA`` is set and small
synthetic files otherwise, no downloads. Checks, each a subprocess with its own time limit:

1. ``recipe/<model>/<dtype>``: every pack recipe (LoRA, QLoRA with an NF4 base, LoRA-DPO, full
   DPO, full fine-tune, QAT, QAT-LoRA) a few steps on the tiny Llama3 and, where the pack ships
   an ECG config for it, on ``hlm_1m``, bf16 and fp32, one process: loss finite, and falling
   where the check says so; ``torchrun/...``: LoRA and full fine-tuning under torchrun at world
   size 1 (NCCL, FSDP2);
2. ``compile/<mode>``: ``compile: True`` with ``compile_mode`` default and ``reduce-overhead``
   (CUDA graphs): first-step loss equal to eager's within ``COMPILE_RTOL``, step times;
3. ``collector/cuda-memory``: the CUDA peak-memory fields present and allocated <= reserved <=
   the device total; ``collector/table``: ``hlmtune collect`` over the runs (iteration times);
4. ``profile/nsys`` when ``nsys`` is on PATH (else a skipped row saying so), ``profile/torch``
   (CUDA kernel rows in the summary);
5. ``bnb/paged-adamw8bit``: LoRA with bitsandbytes' ``PagedAdamW8bit``;
6. ``torchtune/ecg_lora``: torchtune's own ``lora_finetune_distributed`` with
   ``configs/ecg_lora.yaml`` at world size 1 (the design's usage line);
7. ``bench/llama3_8b_lora_fp32``: ``benchmarks/llama3_8b_step.py`` at the papers' settings (random
   Llama3-8B, LoRA, batch 2, fp32), the pack beside torchtune's recipe, when the device has the
   memory and the command runs from a checkout.

``gpu_check/report.md`` and ``report.json`` hold the device, driver / CUDA / torch / torchao /
bitsandbytes versions and one row per check (pass / fail / skipped, why, seconds, peak memory),
rewritten after every check, so a killed run still leaves what it did. Exit status: 0 all
passed or skipped, 1 a check failed, 2 no CUDA device (one line). ``--dry-run`` (CPU, in the test
suite) builds every command and validates every config a check will run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hlmtune.files import atomic_write_text

COLLECTOR = "hlmtune.profiling.collector.CollectorLogger"
STEPS = 8  # optimizer steps per training check: enough for the loss to fall on the tiny models
COMPILE_RTOL = 1e-3  # first-step loss, compiled vs eager, fp32 (inductor reorders reductions)
DEFAULT_LIMIT_S = 90  # per check; the first compile of a model and nsys get more
# Tiny Llama3 checks: pack config, whether a few steps must lower the loss (DPO starts at ln 2
# with policy = reference and moves little in 8 steps: finite is the check). The recipe of each
# is the one the registry names for it (every recipe: LoRA, QLoRA, LoRA-DPO, full DPO, full, QAT, QAT-LoRA).
TINY_CONFIGS = (("tiny_lora", True), ("tiny_qlora", True), ("tiny_lora_dpo", False), ("tiny_full_dpo", False),
                ("tiny_full", True), ("tiny_qat", True), ("tiny_qat_lora", True))
# hlm_1m checks: the ECG configs the pack ships (full DPO and QAT-LoRA have none for the HLM).
ECG_CONFIGS = (("ecg_pretrain", True), ("ecg_lora", True), ("ecg_qlora", True), ("ecg_dpo", False), ("ecg_qat", True))
DTYPES = ("bf16", "fp32")


@dataclass
class Check:
    """One command of the check and how its result is judged.

    Attributes:
        name (str): row name (``recipe/tiny_lora/bf16``).
        argv (List[str]): the command.
        run_dir (Optional[Path]): the training run's ``output_dir`` (metrics under ``metrics/``).
        judge (Callable[[Check], Tuple[str, str, Dict[str, Any]]]): after exit 0: (status, why, extra).
        validate (Optional[Tuple[str, str, List[str]]]): (recipe, config, overrides) checked by ``--dry-run``.
        limit_s (float): time limit; the process group is killed past it.
        needs (Optional[str]): an executable on PATH, else the check is skipped.
        after (Tuple[str, ...]): checks that must have passed first (else skipped, naming them).
        env (Dict[str, str]): environment variables added for the command.
        skip (Optional[str]): why the check cannot run here (known when it is built).
    """

    name: str
    argv: List[str]
    run_dir: Optional[Path] = None
    judge: Optional[Callable[["Check"], Tuple[str, str, Dict[str, Any]]]] = None
    validate: Optional[Tuple[str, str, List[str]]] = None
    limit_s: float = DEFAULT_LIMIT_S
    needs: Optional[str] = None
    after: Tuple[str, ...] = ()
    env: Dict[str, str] = field(default_factory=dict)
    skip: Optional[str] = None  # known before running: why this check cannot run here


# ------------------------------------------------------------------ report
def environment_info() -> Dict[str, Any]:
    """Device name and memory, driver, CUDA, torch, torchao, bitsandbytes, nsys versions."""
    import torch

    info: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": None,
                            "device_total_gib": None, "driver": None}
    for mod in ("torchao", "bitsandbytes", "torchtune"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # an import error is information here, not a crash
            info[mod] = f"not importable ({type(e).__name__})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"], info["device_total_gib"] = props.name, props.total_memory / 1024**3
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    info["nsys"] = shutil.which("nsys")
    return info


def write_report(out: Path, info: Dict[str, Any], rows: List[Dict[str, Any]], *, finished: bool) -> None:
    """``report.json`` and ``report.md`` (atomic; ``finished`` False while checks remain)."""
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in ("pass", "fail", "skipped")}
    body = {"schema": "hlmtune.gpu_check/1", "finished": finished, "environment": info, "counts": counts,
            "checks": rows}
    atomic_write_text(out / "report.json", json.dumps(body, indent=1, default=str) + "\n")
    lines = ["# hlmtune gpu-check", "",
             f"Device: {info.get('device')} ({_fmt(info.get('device_total_gib'))} GiB); driver {info.get('driver')}, "
             f"CUDA {info.get('cuda')}, torch {info.get('torch')}, torchao {info.get('torchao')}, "
             f"bitsandbytes {info.get('bitsandbytes')}, torchtune {info.get('torchtune')}, nsys {info.get('nsys') or 'absent'}.",
             *([f"Inputs: text {info['text']}; ECG {info['ecg']}."] if info.get("text") else []),
             "", ("All checks ran" if finished else "**Incomplete**: checks remain (killed or still running)")
             + f": {counts['pass']} pass, {counts['fail']} fail, {counts['skipped']} skipped.", "",
             "| check | status | why | seconds | peak alloc GiB | notes |", "|---|---|---|---|---|---|"]
    for r in rows:
        notes = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(r.get("extra", {}).items()))
        lines.append(f"| {r['name']} | {r['status']} | {r['why']} | {_fmt(r['seconds'])} | "
                     f"{_fmt(r.get('peak_memory_alloc_gib'))} | {notes} |".replace("\n", " "))
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ------------------------------------------------------------------ running
def run_one(check: Check, log: Path) -> Tuple[Optional[int], float]:
    """Run ``check.argv`` in its own process group; (exit code or None when killed at the limit, seconds)."""
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(check.argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **check.env},
                                start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=check.limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks and compile workers too
            proc.wait()
            rc = None
    return rc, time.perf_counter() - t0


def run_checks(checks: Sequence[Check], out: Path, info: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Run every check in order, writing the report after each; a check that raises is a fail row."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    rows: List[Dict[str, Any]] = []
    status: Dict[str, str] = {}
    for check in checks:
        row = _row_of(check, status, out)
        status[check.name] = row["status"]
        rows.append(row)
        print(f"[gpu-check] {row['status']:<7} {check.name}: {row['why']} ({_fmt(row['seconds'])} s)", flush=True)
        write_report(out, info, rows, finished=False)
    write_report(out, info, rows, finished=True)
    return rows


def _row_of(check: Check, status: Dict[str, str], out: Path) -> Dict[str, Any]:
    row: Dict[str, Any] = {"name": check.name, "status": "skipped", "why": "", "seconds": None, "extra": {},
                           "command": check.argv, "log": str(out / "logs" / f"{_slug(check.name)}.log")}
    if check.skip:
        row["why"] = check.skip
        return row
    missing = [a for a in check.after if status.get(a) != "pass"]
    if missing:
        row["why"] = f"needs {', '.join(missing)} to pass first"
        return row
    if check.needs and shutil.which(check.needs) is None:
        row["why"] = f"{check.needs} is not on PATH"
        return row
    try:
        rc, row["seconds"] = run_one(check, Path(row["log"]))
        if rc is None:
            row["status"], row["why"] = "fail", f"killed at its time limit ({check.limit_s:g} s)"
        elif rc != 0:
            row["status"], row["why"] = "fail", f"exit {rc}: {_tail(Path(row['log']))}"
        else:
            row["status"], row["why"], row["extra"] = check.judge(check) if check.judge else ("pass", "exit 0", {})
        if check.run_dir is not None:
            row["peak_memory_alloc_gib"] = _max_key(check.run_dir, "peak_memory_alloc_gib")
    except Exception as e:  # one broken check is a row, never the end of the command
        row["status"], row["why"] = "fail", f"{type(e).__name__}: {e}"
    return row


def _slug(name: str) -> str:
    return name.replace("/", "__")


def _tail(log: Path, n: int = 300) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return (text[-1] if text else "no output")[-n:]


# ------------------------------------------------------------------ judges
def read_steps(run_dir: Path) -> List[Dict[str, Any]]:
    """The collector's step records of a run (``run_dir/metrics/steps.jsonl``)."""
    from hlmtune.profiling.runs import read_steps as read_steps_file

    path = run_dir / "metrics" / "steps.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: the run wrote no step metrics")
    records, lost = read_steps_file(path)
    if lost:  # a check judges whole runs: a lost line is a failure, not a gap
        raise ValueError("; ".join(lost))
    return records


def _max_key(run_dir: Path, key: str) -> Optional[float]:
    try:
        vals = [r[key] for r in read_steps(run_dir) if r.get(key) is not None]
    except FileNotFoundError:
        return None
    return max(vals) if vals else None


def judge_training(falls: bool) -> Callable[[Check], Tuple[str, str, Dict[str, Any]]]:
    """Loss finite at every step; with ``falls`` the mean of the last 2 below the first 2."""
    def judge(check: Check) -> Tuple[str, str, Dict[str, Any]]:
        steps = read_steps(check.run_dir)
        losses = [s.get("loss") for s in steps]
        times = sorted(s["iteration_time_s"] for s in steps[1:] if s.get("iteration_time_s") is not None)
        extra = {"steps": len(steps), "loss_first": losses[0] if losses else None,
                 "loss_last": losses[-1] if losses else None,
                 "median_step_s": times[len(times) // 2] if times else None}
        if not losses or any(v is None or not math.isfinite(v) for v in losses):
            return "fail", f"loss not finite: {losses}", extra
        if falls and len(losses) >= 4 and sum(losses[-2:]) >= sum(losses[:2]):
            return "fail", f"loss did not fall in {len(losses)} steps ({losses[0]:.4f} -> {losses[-1]:.4f})", extra
        return "pass", "loss finite" + (" and falling" if falls else ""), extra
    return judge


def judge_compile(reference: Path) -> Callable[[Check], Tuple[str, str, Dict[str, Any]]]:
    """First-step loss within ``COMPILE_RTOL`` of the eager run's; reports both step times."""
    def judge(check: Check) -> Tuple[str, str, Dict[str, Any]]:
        status, why, extra = judge_training(False)(check)
        if status != "pass":
            return status, why, extra
        eager = read_steps(reference)
        ref = eager[0]["loss"]
        extra["eager_loss_first"] = ref
        times = sorted(s["iteration_time_s"] for s in eager[1:] if s.get("iteration_time_s") is not None)
        extra["eager_median_step_s"] = times[len(times) // 2] if times else None
        rel = abs(extra["loss_first"] - ref) / max(abs(ref), 1e-12)
        extra["loss_rel_diff"] = rel
        if rel > COMPILE_RTOL:
            return "fail", f"first-step loss {extra['loss_first']:.6f} vs eager {ref:.6f} (rel {rel:.2e} > {COMPILE_RTOL})", extra
        return "pass", f"first-step loss = eager's within {COMPILE_RTOL}", extra
    return judge


def judge_cuda_memory(run_dir: Path, device_total_gib: Optional[float]) -> Callable[[Check], Tuple[str, str, Dict[str, Any]]]:
    """The collector's CUDA fields present at every step and allocated <= reserved <= device total."""
    def judge(_check: Check) -> Tuple[str, str, Dict[str, Any]]:
        steps = read_steps(run_dir)
        keys = ("peak_memory_alloc_gib", "peak_memory_reserved_gib", "peak_memory_active_gib")
        absent = sorted({k for s in steps for k in keys if s.get(k) is None})
        if absent:
            return "fail", f"missing in steps.jsonl: {', '.join(absent)}", {}
        worst = max(steps, key=lambda s: s["peak_memory_reserved_gib"])
        extra = {k: worst[k] for k in keys}
        bad = [s["step"] for s in steps if not 0 < s["peak_memory_alloc_gib"] <= s["peak_memory_reserved_gib"]]
        if bad:
            return "fail", f"allocated > reserved (or 0) at steps {bad}", extra
        if device_total_gib and worst["peak_memory_reserved_gib"] > device_total_gib:
            return "fail", f"reserved {worst['peak_memory_reserved_gib']:.3f} GiB > device total {device_total_gib:.1f}", extra
        return "pass", "present; allocated <= reserved <= device total", extra
    return judge


def judge_file(path: Path, test: Callable[[Any], Optional[str]]) -> Callable[[Check], Tuple[str, str, Dict[str, Any]]]:
    """``test`` (None = good, else why not) on the JSON at ``path`` the command wrote."""
    def judge(_check: Check) -> Tuple[str, str, Dict[str, Any]]:
        if not path.exists():
            return "fail", f"{path} was not written", {}
        problem = test(json.loads(path.read_text()))
        return ("fail", problem, {}) if problem else ("pass", f"{path.name} as expected", {})
    return judge


def _api_rows(category_prefix: str) -> Callable[[Any], Optional[str]]:
    def test(summary: Any) -> Optional[str]:
        ranks = summary.get("ranks") or {}
        rows = [r for body in ranks.values() for r in body.get("rows", []) + body.get("headline", [])]
        if not any(str(r.get("category", "")).startswith(category_prefix) and (r.get("seconds") or 0) > 0 for r in rows):
            return f"no {category_prefix}* rows with time in api_summary.json ({len(ranks)} rank(s))"
        return None
    return test


def judge_table(table_csv: Path, at_least: int) -> Callable[[Check], Tuple[str, str, Dict[str, Any]]]:
    """``hlmtune collect``'s table has a row with an iteration time per run it was given."""
    def judge(_check: Check) -> Tuple[str, str, Dict[str, Any]]:
        import csv

        if not table_csv.exists():
            return "fail", f"{table_csv} was not written", {}
        rows = list(csv.DictReader(table_csv.open()))
        timed = [r for r in rows if r.get("iteration_time_s_mean")]
        extra = {"rows": len(rows), "timed_rows": len(timed)}
        if len(timed) < at_least:
            return "fail", f"{len(timed)} timed row(s), expected at least {at_least}", extra
        return "pass", f"{len(timed)} rows with iteration times", extra
    return judge


# ------------------------------------------------------------------ inputs
@dataclass
class Inputs:
    """What the checks read, made locally: a tiny Llama3, text rows, ECG token shards."""

    model_dir: Path
    text_dir: Path
    text_source: str
    shards_dir: Path
    split_file: Path
    ecg_source: str


def prepare_inputs(out: Path, data: Optional[str]) -> Inputs:
    """Write the tiny model, find or write the text rows, tokenize a few ECG records (seconds on CPU).

    Args:
        out (Path): the check's folder (inputs under ``out/inputs``).
        data (Optional[str]): ``$HLM_DATA`` (``text/`` and ``mitdb/``), or None for synthetic inputs.
    """
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams
    from hlmtune.tiny import write_tiny_assets

    base = out / "inputs"
    model_dir = base / "tiny-llama3"
    if not (model_dir / "config.json").exists():
        write_tiny_assets(model_dir)
    text = Path(data, "text") if data else None
    if text is not None and (text / "alpaca_cleaned.jsonl").exists():
        text_dir, text_source = text, f"{text} (real samples)"
    else:
        text_dir, text_source = write_text_rows(base / "text"), "synthetic rows (no $HLM_DATA/text)"
    mitdb = Path(data, "mitdb") if data else None
    records = ["101", "106", "118", "119"]  # DS1 records with N, S, V and F beats in their first minute
    if mitdb is not None and (mitdb / "101.hea").exists():
        db, options, ecg_source = mitdb, RecordOptions(sampto=360 * 60), f"MIT-BIH {records}, first 60 s"
    else:
        from hlmtune.ecg_tokenizer.synth import write_synthetic_database

        db = base / "synthetic_ecg"
        records = write_synthetic_database(db, n_records=4, duration_s=60.0, seed=0)
        options, ecg_source = RecordOptions(), "synthetic ECG records (no $HLM_DATA/mitdb)"
    shards = base / "ecg_tokens"
    if not (shards / "manifest.json").exists():
        summary = tokenize_directory(db, shards, params=TokenizerParams(), options=options, records=records,
                                     workers=1, progress=False)
        if not summary.ok:
            raise RuntimeError(f"tokenizing the ECG records failed:\n{summary.format()}")
    split = base / "ecg_split.json"  # the last record stands in as the (unused) test patient
    atomic_write_text(split, json.dumps({"DS1": records[:-1], "DS2": records[-1:]}))
    return Inputs(model_dir, text_dir, text_source, shards, split, ecg_source)


def write_text_rows(folder: Path, n: int = 64) -> Path:
    """Seeded synthetic rows in the two formats the tiny configs read (alpaca; hh-rlhf messages)."""
    import random

    rng = random.Random(0)
    words = "heart beat signal model token rhythm sinus wave lead sample patient record".split()

    def sentence(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k)).capitalize() + "."

    folder.mkdir(parents=True, exist_ok=True)
    alpaca = [{"instruction": sentence(8), "input": "", "output": sentence(24)} for _ in range(n)]
    atomic_write_text(folder / "alpaca_cleaned.jsonl", "".join(json.dumps(r) + "\n" for r in alpaca))
    pairs = []
    for _ in range(n):
        prompt = {"role": "user", "content": sentence(10)}
        pairs.append({"chosen": [prompt, {"role": "assistant", "content": sentence(16)}],
                      "rejected": [prompt, {"role": "assistant", "content": sentence(16)}]})
    atomic_write_text(folder / "hh_rlhf_harmless_base_test_messages.jsonl", "".join(json.dumps(r) + "\n" for r in pairs))
    return folder


# ------------------------------------------------------------------ the checks
def _hlmtune() -> List[str]:
    script = Path(sys.executable).with_name("hlmtune")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hlmtune.cli"]


def _train(name: str, recipe: str, config: str, run_dir: Path, overrides: List[str], *, falls: bool,
           nproc: Optional[int] = None, after: Tuple[str, ...] = (), limit_s: float = DEFAULT_LIMIT_S,
           judge: Optional[Callable[[Check], Tuple[str, str, Dict[str, Any]]]] = None) -> Check:
    overrides = [f"output_dir={run_dir}", f"metric_logger._component_={COLLECTOR}",
                 f"metric_logger.log_dir={run_dir}/metrics", f"max_steps_per_epoch={STEPS}", "device=cuda", *overrides]
    argv = [*_hlmtune(), "run", *(["--nproc_per_node", str(nproc)] if nproc else []), recipe, "--config", config, *overrides]
    return Check(name, argv, run_dir=run_dir, judge=judge or judge_training(falls), validate=(recipe, config, overrides),
                 limit_s=limit_s, after=after)


def build_checks(inputs: Inputs, out: Path, device_total_gib: Optional[float]) -> List[Check]:
    """Every check, in the order they run (each within its time limit)."""
    runs = out / "runs"
    tiny = [f"model_dir={inputs.model_dir}", f"data_dir={inputs.text_dir}", "batch_size=2"]
    checks: List[Check] = []
    from hlmtune.registry import recipe_for_config

    for config, falls in TINY_CONFIGS:
        recipe = recipe_for_config(config)
        for dtype in DTYPES:
            checks.append(_train(f"recipe/{config}/{dtype}", recipe, config, runs / f"{config}_{dtype}",
                                 [*tiny, f"dtype={dtype}"], falls=falls))
    ecg = [f"shards_dir={inputs.shards_dir}", f"split_file={inputs.split_file}", "extra_records=null"]
    for config, falls in ECG_CONFIGS:
        recipe = recipe_for_config(config)
        for dtype in DTYPES:
            over = [*ecg, f"dtype={dtype}"]
            after: Tuple[str, ...] = ()
            if config == "ecg_pretrain":
                over.append("batch_size=4")
            elif config == "ecg_dpo":  # DPO starts from this dtype's LoRA classifier (merged weights)
                over += [f"sft_dir={runs / f'ecg_lora_{dtype}'}", "batch_size=8", f"dataset.num_examples={8 * STEPS}"]
                after = (f"recipe/ecg_lora/{dtype}",)
            else:  # the other fine-tunes start from this dtype's pretraining check
                over += [f"pretrain_dir={runs / f'ecg_pretrain_{dtype}'}", "batch_size=8", f"dataset.num_examples={8 * STEPS}"]
                after = (f"recipe/ecg_pretrain/{dtype}",)
            checks.append(_train(f"recipe/{config}/{dtype}", recipe, config, runs / f"{config}_{dtype}", over,
                                 falls=falls, after=after))
    for recipe, config in (("lora_finetune_distributed", "tiny_lora"), ("full_finetune_distributed", "tiny_full")):
        checks.append(_train(f"torchrun/{config}/fsdp2", recipe, config, runs / f"torchrun_{config}",
                             [*tiny, "dtype=bf16", "data_parallel=fsdp"], falls=True, nproc=1))
    eager = runs / "tiny_lora_fp32"
    for mode, extra in (("default", []), ("reduce-overhead", ["data_parallel=ddp"])):  # graphs: no FSDP
        checks.append(_train(f"compile/{mode}", "lora_finetune_distributed", "tiny_lora", runs / f"compile_{mode}",
                             [*tiny, "dtype=fp32", "compile=True", f"compile_mode={mode}", *extra], falls=False,
                             after=("recipe/tiny_lora/fp32",), limit_s=240, judge=judge_compile(eager)))
    checks.append(Check("collector/cuda-memory", [sys.executable, "-c", "pass"], judge=judge_cuda_memory(
        runs / "tiny_lora_bf16", device_total_gib), after=("recipe/tiny_lora/bf16",), limit_s=30))
    checks.append(Check("collector/table", [*_hlmtune(), "collect", str(runs), "--out", str(out / "table")],
                        judge=judge_table(out / "table" / "table.csv", at_least=len(TINY_CONFIGS)), limit_s=120))
    checks += _profile_checks(inputs, out, tiny)
    checks.append(_train("bnb/paged-adamw8bit", "lora_finetune_distributed", "tiny_lora", runs / "bnb_paged_adamw8bit",
                         [*tiny, "dtype=bf16", "optimizer._component_=bitsandbytes.optim.PagedAdamW8bit",
                          "~optimizer.fused"], falls=True))
    tt_dir = runs / "torchtune_ecg_lora"
    tt_over = [*ecg, f"pretrain_dir={runs / 'ecg_pretrain_bf16'}", "dtype=bf16", "batch_size=8",
               f"dataset.num_examples={8 * STEPS}", f"max_steps_per_epoch={STEPS}", "device=cuda",
               f"output_dir={tt_dir}", f"metric_logger._component_={COLLECTOR}", f"metric_logger.log_dir={tt_dir}/metrics"]
    checks.append(Check("torchtune/ecg_lora", [str(Path(sys.executable).with_name("tune")), "run", "--nproc_per_node", "1",
                                               "lora_finetune_distributed", "--config", str(_config_file("ecg_lora")),
                                               *tt_over],
                        run_dir=tt_dir, judge=judge_training(True), after=("recipe/ecg_pretrain/bf16",), limit_s=150))
    checks.append(_llama3_8b_check(out, device_total_gib))
    return checks


LLAMA3_8B_GIB = 80  # LoRA fp32 at batch 2: 32 GB of weights + activations and the 128,256-wide logits


def _llama3_8b_check(out: Path, device_total_gib: Optional[float]) -> Check:
    """benchmarks/llama3_8b_step.py, LoRA fp32 at the papers' settings, pack beside torchtune (a checkout only)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "llama3_8b_step.py"
    work = out / "llama3_8b"
    argv = [sys.executable, str(script), "--methods", "lora", "--dtypes", "fp32", "--ac", "off", "--steps", "6",
            "--warmup", "2", "--limit-s", "200", "--work", str(work)]
    skip = None
    if not script.exists():
        skip = "benchmarks/ is not installed with the package: run from a checkout"
    elif device_total_gib is not None and device_total_gib < LLAMA3_8B_GIB:
        skip = f"the device has {device_total_gib:.0f} GiB; Llama3-8B LoRA fp32 needs about {LLAMA3_8B_GIB}"

    def judge(_check: Check) -> Tuple[str, str, Dict[str, Any]]:
        res = json.loads((work / "results.json").read_text())
        by = {r["framework"]: r for r in res["results"]}
        extra = {f"{fw}_s_per_it": r.get("s_per_it") for fw, r in by.items()}
        extra.update({f"{fw}_peak_alloc_gib": r.get("peak_alloc_gib") for fw, r in by.items()})
        bad = {fw: r["status"] for fw, r in by.items() if r["status"] != "ok"}
        if bad:
            return "fail", f"runs did not finish: {bad}", extra
        return "pass", f"pack {by['pack']['s_per_it']:.3f} s/it, torchtune {by['torchtune']['s_per_it']:.3f} s/it (papers 0.77)", extra

    return Check("bench/llama3_8b_lora_fp32", argv, judge=judge, limit_s=480, skip=skip)


def _profile_checks(inputs: Inputs, out: Path, tiny: List[str]) -> List[Check]:
    checks = []
    for tool, category, needs in (("nsys", "cuda_api", "nsys"), ("torch", "gpu_kernel", None)):
        prof = out / f"profile_{tool}"
        run = _train("", "lora_finetune_distributed", "tiny_lora", prof / "run", [*tiny, "dtype=bf16"], falls=False)
        argv = [*_hlmtune(), "profile", tool, "--out", str(prof), "--", *run.argv]
        checks.append(Check(f"profile/{tool}", argv, judge=judge_file(prof / "api_summary.json", _api_rows(category)),
                            validate=run.validate, limit_s=240, needs=needs))
    return checks


def _config_file(name: str) -> Path:
    from hlmtune.registry import resolve_config

    return resolve_config(name)


def dry_run(checks: Sequence[Check]) -> List[Tuple[str, Optional[str]]]:
    """Validate every config a check will run, as ``hlmtune validate`` does; (check, problem or None)."""
    from hlmtune.compat import load_config
    from hlmtune.registry import resolve_config, resolve_recipe
    from hlmtune.training.schema import ConfigError, validate_config

    results = []
    for check in checks:
        problem = None
        if check.validate is not None:
            recipe, config, overrides = check.validate
            try:
                cfg = load_config(str(resolve_config(config)), list(overrides))
                validate_config(cfg, resolve_recipe(recipe).spec)
            except ConfigError as e:
                problem = "; ".join(e.problems)
            except Exception as e:  # noqa: BLE001 - every kind of bad config is a row here
                problem = f"{type(e).__name__}: {e}"
        results.append((check.name, problem))
    return results


# ------------------------------------------------------------------ CLI
def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "gpu-check", help="run every CUDA path of the pack for a few steps and write gpu_check/report.md",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check", help="folder for report.md / report.json, logs and runs (default: gpu_check)")
    p.add_argument("--data", default=os.environ.get("HLM_DATA"),
                   help="data folder with text/ and mitdb/ (default: $HLM_DATA; synthetic inputs without it)")
    p.add_argument("--only", nargs="+", metavar="PREFIX", default=None,
                   help="run only the checks whose name starts with one of these (e.g. recipe/tiny_lora compile)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: prepare the inputs, build every command and validate every config; exit 1 on a problem")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("hlmtune gpu-check: no CUDA device here (torch.cuda.is_available() is False); "
                  "--dry-run validates the checks without one", file=sys.stderr)
            return 2
    inputs = prepare_inputs(out, args.data)
    info = environment_info()
    info.update(text=inputs.text_source, ecg=inputs.ecg_source)
    checks = build_checks(inputs, out, info.get("device_total_gib"))
    if args.only:
        checks = [c for c in checks if c.name.startswith(tuple(args.only))]
    if args.dry_run:
        results = dry_run(checks)
        for c, (name, problem) in zip(checks, results):
            print(f"{'ok' if problem is None else 'PROBLEM':<8} {name}: {' '.join(c.argv)}"
                  + (f"\n         {problem}" if problem else ""))
        bad = [n for n, p in results if p]
        print(f"{len(checks)} check(s) built, {len(results) - len(bad)} config(s) valid" + (f"; problems: {bad}" if bad else ""))
        return 1 if bad else 0
    rows = run_checks(checks, out, info)
    failed = [r["name"] for r in rows if r["status"] == "fail"]
    print(f"hlmtune gpu-check: {len(rows) - len(failed)} of {len(rows)} passed or skipped; report: {out / 'report.md'}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
