"""``hlmtune demo``: the Heart Language Model end to end, in one command.

Stages (each resumes: a finished stage is not redone unless ``--force``):

1. **data**: MIT-BIH from ``--data`` or ``$HLM_DATA/mitdb``; else ``wfdb.dl_database("mitdb")``
   for users online; else a synthetic WFDB database (``hlmtune synth-ecg``), named as such in
   every output;
2. **tokenize**: the DS1 and DS2 records into heartbeat tokens (signal only);
3. **pretrain**: ``ecg_pretrain`` with the pack's ``full_finetune_distributed`` (random init),
   ``--nproc`` CPU ranks, recorded by the profiling collector;
4. **fine-tune**: ``ecg_lora`` (LoRA adapters for beat classes) from the pretrained weights;
   with ``--seeds K``, K such runs that differ only in their seed (initialization, example
   draw, augmentation);
5. **evaluate**: ``hlmtune eval`` on DS2 (unseen patients); with ``--seeds K`` the K runs vote
   as an ensemble (mean class log-probability, ``hlmtune eval --ensemble``);
6. **report**: ``report/report.md`` with loss curves, iteration time and peak memory per step,
   the confusion matrix, the table beside the published baselines and the per-record table of
   the result (PNG plots next to it).

The path of the report is printed last. On 2 idle CPU cores with MIT-BIH the defaults take
about 10 minutes (``README.md``, "Measured here").
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hlmtune.helpformat import DefaultsHelpFormatter
from hlmtune.files import OutputPathError
from hlmtune.proc import child_dies_with_us
from hlmtune.ecg_tokenizer.splits import SplitError, load_split_file

COLLECTOR = "hlmtune.profiling.collector.CollectorLogger"
# RR bins of 28 ms (64 over 0.2-2.0 s) instead of the tokenizer's default 112 ms: the
# prematurity of supraventricular beats (often 10-20% of the RR, i.e. 80-160 ms at 75 bpm) and
# the RR-ratio features of the inter-patient literature (de Chazal 2004) need the finer grid.
RR_BINS = 64
DISK_LOGGER = "torchtune.training.metric_logging.DiskLogger"
SYNTHETIC_MARK = "SYNTHETIC"  # file in a database written by synthetic_database()
# Pretraining steps of the main job, `hlmtune cv` and benchmarks/ecg_quality.py: 600 beat 200 in DS1
# cross-validation (docs/hlm.md, "pretraining 600 steps instead of 200"); ~5 min on 2 CPU ranks.
PRETRAIN_STEPS = 600
# LoRA fine-tuning examples of the same three (each fine-tune's `dataset.num_examples`), and
# configs/ecg_lora.yaml's, so that `tune run` on the config trains what the main job does:
# 36,000, adopted by the plan `hlm_61_patients` (candidate 1: pooled cross-validated macro-F1
# 0.593 -> 0.621 over the 61 training patients, 3 of 4 folds; docs/selection/hlm_61_patients);
# 24,000 had beaten 12,000 on held-out DS1 records. ~4.5 min per fine-tune on 2 CPU ranks.
FINETUNE_EXAMPLES = 36000
# Version of what the evaluation stage writes, kept in its stage stamp: an evaluation stamped
# with an older version (or none) is redone on rerun, the trained models kept. 2: predictions.npz
# names each test beat's record (the per-record tables of the report and of `hlmtune cv`); 3: and
# each beat's RR relative to the patient's running reference (the timing tables).
EVAL_FORMAT = 3


def _say(msg: str) -> None:
    print(f"[hlmtune demo] {msg}", file=sys.stderr, flush=True)


def find_data(data: Optional[str], out: Path, source: str) -> Tuple[Path, str, Optional[Path]]:
    """Where the WFDB records come from.

    Args:
        data (Optional[str]): explicit database folder.
        out (Path): the demo folder (downloads and synthetic records go under it).
        source (str): ``auto`` (given folder, then ``$HLM_DATA/mitdb``, then download, then
            synthetic), ``mitdb``, ``download`` or ``synthetic``.

    Returns:
        Tuple[Path, str, Optional[Path]]: (folder, description, split file or None for MIT-BIH).
    """
    if data is not None:
        p = Path(data)
        if not (p / "100.hea").exists() and not (p / "splits.json").exists():
            raise FileNotFoundError(f"--data {p}: no MIT-BIH records (100.hea) and no splits.json of a synthetic database")
        split_file = p / "splits.json" if (p / "splits.json").exists() else None
        if split_file is None:
            return p, f"MIT-BIH Arrhythmia Database ({p})", None
        if (p / SYNTHETIC_MARK).exists():
            return p, "SYNTHETIC ECG (hlmtune synth-ecg; not MIT-BIH: numbers say nothing about real patients)", split_file
        return p, f"WFDB database {p} with the splits of {split_file}", split_file
    env = os.environ.get("HLM_DATA")
    if source in ("auto", "mitdb") and env and (Path(env) / "mitdb" / "100.hea").exists():
        return Path(env) / "mitdb", f"MIT-BIH Arrhythmia Database ($HLM_DATA/mitdb = {Path(env) / 'mitdb'})", None
    if source == "mitdb":
        if env:
            raise FileNotFoundError(f"--source mitdb: no MIT-BIH records (100.hea) in $HLM_DATA/mitdb = "
                                    f"{Path(env) / 'mitdb'}; point HLM_DATA at the folder holding mitdb/ or give --data")
        raise FileNotFoundError("--source mitdb: set HLM_DATA (folder with mitdb/) or give --data")
    if source in ("auto", "download"):
        dest = out / "data" / "mitdb"
        if (dest / "234.atr").exists():
            return dest, f"MIT-BIH Arrhythmia Database (downloaded to {dest})", None
        try:
            import wfdb

            # Into a side folder renamed when complete: an interrupted download never looks like
            # the database, and a rerun resumes it (wfdb skips files already there at full size).
            partial = dest.with_name(dest.name + ".partial")
            _say(f"downloading MIT-BIH from PhysioNet (about 100 MB) into {partial}")
            wfdb.dl_database("mitdb", str(partial))
            if dest.exists():  # an older version's interrupted download (no 234.atr): replaced
                import shutil

                shutil.rmtree(dest)
            partial.rename(dest)
            return dest, f"MIT-BIH Arrhythmia Database (downloaded to {dest})", None
        except Exception as e:  # offline: requests raises ConnectionError (an OSError) and friends
            if source == "download":
                raise FileNotFoundError(f"cannot download MIT-BIH ({type(e).__name__}: {str(e)[:200]})") from None
            _say(f"no MIT-BIH here and no internet ({type(e).__name__}): using SYNTHETIC ECG records instead")
    return synthetic_database(out / "data" / "synthetic"), "SYNTHETIC ECG (hlmtune synth-ecg; not MIT-BIH: numbers say nothing about real patients)", None


def find_svdb(svdb: Optional[str], *, mitdb: bool) -> Optional[Path]:
    """The MIT-BIH Supraventricular Arrhythmia Database folder that adds training patients, or None.

    Args:
        svdb (Optional[str]): ``auto`` (``$HLM_DATA/svdb`` when it holds records), a folder, or
            None / ``none``.
        mitdb (bool): whether the job's data is MIT-BIH (its DS1/DS2): svdb joins only MIT-BIH
            (a synthetic or other database keeps its own patients).

    Returns:
        Optional[Path]: the folder.

    Raises:
        FileNotFoundError: a folder given that holds no WFDB records.
    """
    if svdb in (None, "none", ""):
        return None
    if svdb != "auto":
        p = Path(svdb)
        if not any(p.glob("*.hea")):
            raise FileNotFoundError(f"--svdb {p}: no WFDB records (*.hea) there")
        return p
    env = os.environ.get("HLM_DATA")
    p = Path(env) / "svdb" if env else None
    return p if mitdb and p is not None and any(p.glob("*.hea")) else None


def synthetic_database(path: Path, n_records: int = 8, duration_s: float = 300.0) -> Path:
    """A synthetic WFDB database with a ``splits.json`` (first 5 records train, the rest test)."""
    from hlmtune.files import atomic_write_text
    from hlmtune.ecg_tokenizer.synth import write_synthetic_database

    if not (path / "splits.json").exists():
        names = write_synthetic_database(path, n_records=n_records, duration_s=duration_s, seed=0)
        k = max(1, (len(names) * 5) // 8)
        atomic_write_text(path / SYNTHETIC_MARK, "records written by hlmtune synth-ecg, not real patients\n")
        atomic_write_text(path / "splits.json", json.dumps({"DS1": names[:k], "DS2": names[k:]}, indent=1) + "\n")
    return path


def _run(cmd: List[str], env: Dict[str, str], log: Path) -> None:
    """Run one training stage; its progress bar goes to the terminal, everything to ``log``."""
    _say("$ " + " ".join(cmd))
    with open(log, "w") as f:
        # a killed cv or demo takes its stage along (and the stage its ranks: hlmtune.proc)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                preexec_fn=child_dies_with_us())
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if "it/s" in line or "s/it" in line or "Error" in line:
                sys.stderr.write(line.split("\r")[-1] if "\r" in line else line)
        rc = proc.wait()
    if rc != 0:
        tail = log.read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"stage failed (exit {rc}): {' '.join(cmd[:6])} ...; log {log}:\n" + "\n".join(tail))


STAGE_STAMP = "stage.json"  # the command a finished stage ran: a rerun with other settings redoes it
# Stands for the job folder in stage stamps, so that a copied or moved job folder (`cp -r outputs/cv
# outputs/cv_b`) keeps its finished stages: their commands differ only in where the job lives.
JOB_ROOT = "{job}"


def portable(values: Sequence[str], root: Optional[Path]) -> List[str]:
    """``values`` (``key=value`` settings, or paths) with the job folder ``root`` written as ``{job}``.

    Only whole path components match: with ``root`` ``/a/cv``, ``/a/cv/tokens`` becomes
    ``{job}/tokens`` and ``/a/cv_b/tokens`` stays as it is. Paths outside the job (the WFDB
    database of ``$HLM_DATA``) stay absolute: a copy of the job reads the same records.

    Args:
        values (Sequence[str]): settings or paths.
        root (Optional[Path]): the job folder (absolute); None leaves ``values`` as they are.

    Returns:
        List[str]: the values, job-relative where they name something inside the job.
    """
    if root is None:
        return list(values)
    at = re.compile(r"(?:(?<==)|^)" + re.escape(str(root).rstrip("/")) + r"(?=/|$)")
    return [at.sub(lambda _: JOB_ROOT, v) for v in values]


def _stamped_root(command: Sequence[str], run_dir: Path, root: Optional[Path]) -> Optional[str]:
    """The job folder an older stamp (absolute paths) was made in, read from its ``output_dir=``.

    A stamp written before stamps were job-relative names the folder it was made in; copied with
    its job (``cp -r cv cv_b``), its ``output_dir`` is that folder plus this run's place in the
    job. None when the stamp has no such entry or ``run_dir`` is not inside ``root``.
    """
    if root is None:
        return None
    try:
        inside = run_dir.relative_to(root).as_posix()
    except ValueError:
        return None
    for value in command:
        if value.startswith("output_dir="):
            out = value[len("output_dir="):].rstrip("/")
            if out.endswith("/" + inside) and len(out) > len(inside) + 1:
                return out[: -len(inside) - 1]
    return None


def examples_trained(finetune_examples: int, finetune_overrides: Sequence[str]) -> int:
    """The examples a fine-tune draws: a ``dataset.num_examples=`` override wins over the flag.

    The override comes after ``--finetune-examples``'s own setting on the fine-tune's command line,
    so the recipe reads the override; messages and reports must name that number too.
    """
    for kv in reversed(list(finetune_overrides)):
        key, _, value = kv.partition("=")
        if key.strip() == "dataset.num_examples":
            try:
                return int(value)
            except ValueError:
                return finetune_examples  # not a number: the recipe's own validation names it
    return finetune_examples


def _train_stage(name: str, run_dir: Path, done: Path, force: bool, env: Dict[str, str], what: str,
                 cmd: List[str], root: Optional[Path] = None,
                 data: Optional[str] = None) -> Tuple[Optional[float], bool]:
    """Run one training stage unless it finished before with the same command.

    A stage counts as finished when its export ``done`` exists and ``run_dir/stage.json``
    records the same command (settings, upstream paths, rank count); otherwise it runs (again),
    so ``--finetune-examples 24000`` after a 12,000-example run retrains instead of reporting
    the old model. The stamp also records the stage's wall time, so a kept stage still reports
    what it cost when it ran (not the zero seconds of keeping it). Paths inside the job folder
    ``root`` are stamped relative to it (:func:`portable`), so a copied or moved job keeps the
    stage; a stamp of an older version with absolute paths counts where it was made and in a copy
    of its job (its job folder read from its own ``output_dir``), and is rewritten job-relative.
    ``data`` (:func:`data_digest`) is stamped too: the same command over other records or another
    split file under the same paths runs again. A stamp of an older version without it is taken
    as it was (nothing recorded what it read) and gets the digest.

    Returns:
        Tuple[Optional[float], bool]: (wall time of the training in s, measured now or recorded when
        the kept run ran; None for a kept run stamped before times were recorded; whether it ran:
        stages downstream must then rerun).
    """
    from hlmtune.files import atomic_write_text

    t0 = time.perf_counter()
    stamp = run_dir / STAGE_STAMP
    settings = cmd[1:]  # the interpreter's path is not a setting
    stamped = portable(settings, root)
    before = json.loads(stamp.read_text()) if stamp.exists() else {}
    was = before.get("command")
    if was is not None and was != stamped:
        # an older stamp with absolute paths: compared as if it had been job-relative, so that it
        # counts where it was made and in a copy of its job; kept, it is rewritten job-relative
        made_in = _stamped_root(was, run_dir, root)
        if made_in is not None and portable(was, Path(made_in)) == stamped:
            was = stamped
    same_data = before.get("data") in (data, None)
    if not force and done.exists() and was in (stamped, settings) and same_data:
        upgraded = {**before, **({"command": stamped} if root is not None else {}),
                    **({"data": data} if data is not None else {})}
        if upgraded != before:
            atomic_write_text(stamp, json.dumps(upgraded, indent=1) + "\n")
        _say(f"{name}: finished before, kept ({run_dir}; --force redoes it)")
        return before.get("wall_s"), False
    if done.exists() and not force:
        why = "other settings (or by an older version)" if same_data else "other data (records or split file)"
        _say(f"{name}: the run in {run_dir} was made with {why}: redoing it")
    run_dir.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)  # an interrupted rerun must not look finished
    _say(what)
    _run(cmd, env, run_dir / "train.log")
    took = time.perf_counter() - t0
    done_stamp = {"command": stamped, "wall_s": round(took, 3), **({"data": data} if data is not None else {})}
    atomic_write_text(stamp, json.dumps(done_stamp, indent=1) + "\n")
    return took, True


def data_digest(tokens: Path, lists: Dict[str, Sequence[str]], records: Sequence[str],
                outputs: Optional[Sequence[str]] = None) -> str:
    """sha256 of what a job's models read: the tokenizer parameters, each record's shards (the
    sha256s the token manifest records for them) and the split lists.

    Library versions and other manifest bookkeeping are left out, so that re-tokenizing the same
    records the same way keeps the trained models. ``outputs`` limits the shards to those kinds
    (the pretraining reads ``tokens`` and ``beats``, not the second lead's ``lead2``, so shards
    re-made with the second lead keep its models); None: every kind.
    """
    import hashlib

    from hlmtune.ecg_tokenizer.splits import match_records

    manifest = json.loads((Path(tokens) / "manifest.json").read_text())
    by_name = {r["record"]: r for r in manifest["records"]}
    ids = [r for r in match_records(records, list(by_name)) if r]  # names as lists give them -> shard ids
    shards = {r: {k: o.get("sha256") for k, o in sorted(by_name[r]["outputs"].items()) if outputs is None or k in outputs}
              for r in ids}
    doc = {"params": manifest.get("params"), "shards": shards, "split": {k: list(v) for k, v in lists.items()}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _train_cmd(nproc: int, recipe: str, config: str, overrides: Sequence[str], run_dir: Path) -> List[str]:
    hlm = [sys.executable, "-m", "hlmtune.cli", "run"]
    launch = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    logger = [
        f"metric_logger._component_={COLLECTOR}", f"metric_logger.log_dir={run_dir / 'metrics'}",
        f"metric_logger.wrapped._component_={DISK_LOGGER}", f"metric_logger.wrapped.log_dir={run_dir / 'logs'}",
    ]
    return [*hlm, *launch, recipe, "--config", config, f"output_dir={run_dir}", *logger, *overrides]


# At most this many windows start within one window length: each token is then seen at up to 4
# positions of its window. Denser windows are the same data again (near-identical windows) at a
# cost linear in the steps: the synthetic demo's 8 records would take 600 steps at windows every
# 25 tokens (20-fold overlap, 5 minutes of pretraining on 2 CPU ranks) instead of ~120 steps.
MAX_WINDOW_OVERLAP = 4


def pretrain_dirs(out: Path, pretrainings: int) -> List[Path]:
    """The run folders of a job's pretrained models 0..P-1 (``runs/pretrain``, ``runs/pretrain_seed1``, ...).

    Folder p holds the pretraining of seed ``--pretrain-seed`` + p (the names are indices).

    Args:
        out (Path): the job folder (``hlmtune demo --out``, or one fold of ``hlmtune cv``).
        pretrainings (int): how many pretrained models the job has.

    Returns:
        List[Path]: one run folder per pretraining; the fine-tunes read ``<folder>/epoch_0``.
    """
    return [out / "runs" / ("pretrain" if p == 0 else f"pretrain_seed{p}") for p in range(pretrainings)]


def pretrain_schedule(steps: int, tokens: Path, split_file: Optional[Path], nproc: int,
                      extra_records: Optional[str] = None) -> Tuple[Optional[int], int]:
    """The pretraining window stride that lets one epoch hold ``steps`` optimizer steps.

    ``max_steps_per_epoch`` stops at the end of the epoch, and an epoch of packed 512-token
    DS1 windows is ~800 steps at 2 ranks. Rather than repeat identical windows in a second
    epoch (and move the export to ``epoch_1``, where no fine-tuning config looks), windows then
    start every ``stride / k`` tokens (the config's stride, ``max_seq_len`` when unset) for the
    smallest k that holds the steps: with packed windows each token is seen at k different
    positions of its window, and the export stays ``epoch_0/model.pt``. k stops at
    ``MAX_WINDOW_OVERLAP``; past it pretraining stops at the end of that densest epoch.

    Args:
        steps (int): optimizer steps wanted.
        tokens (Path): the shards (``hlmtune tokenize`` output).
        split_file (Optional[Path]): split lists of another database (None: MIT-BIH DS1).
        nproc (int): ranks; the shipped config splits the windows into equal per-rank blocks.
        extra_records (Optional[str]): the training patients beside DS1 (``svdb``), as the
            pretraining run gets them.

    Returns:
        Tuple[Optional[int], int]: the stride (None: the config's own) and the steps of the
        epoch at that stride (``steps`` unless even the densest allowed windows are too few).
    """
    from omegaconf import OmegaConf

    from hlmtune.data_builders.ecg import ecg_pretrain_dataset
    from hlmtune.ecg_tokenizer.tokenizer import ecg_tokenizer
    from hlmtune.registry import resolve_config

    if steps < 1:
        raise ValueError(f"--pretrain-steps must be >= 1, got {steps}")
    cfg = OmegaConf.load(resolve_config("ecg_pretrain"))
    seq = int(cfg.dataset.max_seq_len)
    tok = ecg_tokenizer(manifest_path=str(tokens))

    def epoch_steps(stride: Optional[int]) -> int:
        ds = ecg_pretrain_dataset(tok, shards_dir=str(tokens), max_seq_len=seq, stride=stride,
                                  split_file=str(split_file) if split_file else None, extra_records=extra_records)
        # The recipe's loader: per-rank blocks of len // nproc windows, batches of batch_size, last dropped.
        return (len(ds) // nproc) // int(cfg.batch_size)

    stride = cfg.dataset.get("stride", None)
    base = stride or seq  # the configured stride; k divides it, so the windows only ever get denser
    per_epoch = epoch_steps(stride)
    k = 1
    while per_epoch < steps and k < MAX_WINDOW_OVERLAP and base // (k + 1) >= 1:
        k += 1
        stride = base // k
        per_epoch = epoch_steps(stride)
    if per_epoch < 1:
        raise ValueError(f"the pretraining windows of {tokens} do not fill one batch per rank")
    return stride, min(steps, per_epoch)


def _steps(run_dir: Path) -> List[Dict[str, Any]]:
    path = run_dir / "metrics" / "steps.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def plot_training(runs: Dict[str, List[Dict[str, Any]]], out: Path) -> List[str]:
    """Loss, iteration time and peak memory per step of each stage (PNG files in ``out``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hlmtune.files import atomic_write_bytes

    files = []
    for key, ylabel, fname in (
        ("loss", "loss (nats / trained token)", "loss.png"),
        ("iteration_time_s", "iteration time (s)", "iteration_time.png"),
        ("peak_rss_gib", "peak RSS, max over ranks (GiB)", "peak_memory.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for name, steps in runs.items():
            xs = [s.get("step", i + 1) for i, s in enumerate(steps) if key in s]
            ys = [s[key] for s in steps if key in s]
            if not ys and key == "peak_rss_gib":  # CUDA runs log allocator peaks instead
                ys = [s["peak_memory_alloc_gib"] for s in steps if "peak_memory_alloc_gib" in s]
                xs = xs[: len(ys)] or list(range(1, len(ys) + 1))
            ax.plot(xs, ys, label=name, lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        if key != "loss":
            ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        atomic_write_bytes(out / fname, buf.getvalue())
        files.append(fname)
    return files


def _total(seconds: Sequence[Optional[float]]) -> Optional[float]:
    """Sum of stage wall times; None when one is unknown (a partial sum would look complete)."""
    return None if any(s is None for s in seconds) else float(sum(seconds))  # type: ignore[arg-type]


def _stage_summary(name: str, steps: List[Dict[str, Any]], seconds: Optional[float], kept: bool = False) -> str:
    wall = ("unknown" if seconds is None else f"{seconds:.0f}") + (" (kept)" if kept else "")
    if not steps:
        return f"| {name} | 0 | - | - | - | - | {wall} |"
    it = sorted(s["iteration_time_s"] for s in steps[1:] or steps)
    med = it[len(it) // 2]
    peak = max(s.get("peak_rss_gib", s.get("peak_memory_alloc_gib", 0.0)) for s in steps)
    tps = sum(s.get("tokens", 0) for s in steps) / max(1e-9, sum(s["iteration_time_s"] for s in steps))
    return (f"| {name} | {len(steps)} | {steps[0]['loss']:.3f} | {steps[-1]['loss']:.3f} | {med:.3f} | "
            f"{peak:.2f} | {wall} ({tps:,.0f} trained tokens/s) |")


def run_pipeline(
    *, out: Path, data: Optional[str] = None, source: str = "auto", nproc: int = 2, pretrain_steps: int = PRETRAIN_STEPS,
    finetune_examples: int = FINETUNE_EXAMPLES, max_eval: Optional[int] = None, model: str = "hlm_1m", force: bool = False,
    seeds: int = 1, tokens_dir: Optional[Path] = None, finetune_overrides: Sequence[str] = (),
    calibration: Optional[Path] = None, pretrainings: int = 1, job_root: Optional[Path] = None,
    pretrain_seed: int = 0, svdb: Optional[str] = "auto", pretrain_only: bool = False, train_only: bool = False,
) -> Path:
    """Run every stage (or those up to the pretraining, or the fine-tunes); returns the report path
    (the job folder, or the training record).

    Args:
        out (Path): demo folder (data, tokens, runs, report).
        data (Optional[str]): WFDB folder (MIT-BIH, or a synthetic database with splits.json).
        source (str): see :func:`find_data`.
        nproc (int): CPU ranks of the training stages.
        pretrain_steps (int): pretraining optimizer steps (batch 8 x 512 tokens per rank).
        finetune_examples (int): LoRA fine-tuning examples (class-balanced draw from DS1).
        max_eval (Optional[int]): evaluate only the first N DS2 beats (smoke runs).
        model (str): ``hlm_1m``, ``hlm_10m`` or ``hlm_100m``.
        force (bool): redo finished stages.
        seeds (int): LoRA fine-tunes, seeds 0..K-1 (``runs/lora``, ``runs/lora_seed1``, ...),
            evaluated as one ensemble when K > 1.
        pretrainings (int): pretrained models, seeds ``pretrain_seed`` + 0..P-1 (``runs/pretrain``,
            ``runs/pretrain_seed1``, ...); fine-tune k starts from pretraining k mod P (its run
            is ``runs/lora_seed{k}_pre{k mod P}`` when that is not 0). 1 to ``seeds``.
        pretrain_seed (int): the first pretraining's seed: pretraining p has seed
            ``pretrain_seed + p`` (folders keep their index names). Another value gives another
            set of pretrained models on the same data, to see whether a fine-tuning setting's
            effect holds beyond one set; the fine-tunes' seeds stay 0..K-1.
        tokens_dir (Optional[Path]): where the tokens go (default ``out/tokens``; ``hlmtune cv``
            shares one folder between its folds).
        finetune_overrides (Sequence[str]): ``key=value`` overrides of the fine-tune(s).
        calibration (Optional[Path]): class-bias file of ``hlmtune cv`` (fitted on DS1 only),
            applied in the evaluation (``hlmtune eval --calibration``).
        job_root (Optional[Path]): the folder a copy of the job is made of (default ``out``;
            ``hlmtune cv`` gives its own, which holds the folds and their shared tokens): stage
            stamps name paths inside it relative to it, so the copy keeps the finished stages.
        svdb (Optional[str]): extra training patients, the MIT-BIH Supraventricular Arrhythmia
            Database: ``auto`` (``$HLM_DATA/svdb`` when it is there and the data is MIT-BIH), a
            folder, or None / ``none`` (DS1 only).
        pretrain_only (bool): stop after the pretraining stage and return the job folder
            (``hlmtune cv --check-pretraining``: does this host pretrain to the same bytes?).
        train_only (bool): stop after the fine-tunes, without reading the test split: writes
            ``training.json`` (the stages' wall times and runs) in the job folder and returns its
            path. A later call without it keeps the trained stages and evaluates them
            (``benchmarks/ecg_quality.py --train-only``: the training budget, DS2 unread).
    """
    from hlmtune.files import ensure_dir
    from hlmtune.hlm.model import ARCHS

    if model not in ARCHS:
        raise ValueError(f"--model must be one of {sorted(ARCHS)}, got {model!r}")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    bad = pretrainings_error(pretrainings, seeds)
    if bad:
        raise ValueError(bad)
    if pretrain_seed < 0:
        raise ValueError(f"--pretrain-seed must be >= 0, got {pretrain_seed}")
    if calibration is not None and not Path(calibration).is_file():  # before hours of training, not after
        raise FileNotFoundError(f"--calibration {calibration}: no such file (hlmtune cv writes calibration.json)")
    out = ensure_dir(out, "--out").resolve()
    job = Job(out=out, root=Path(job_root).resolve() if job_root is not None else out, model=model, nproc=nproc,
              force=force)
    t_all = time.perf_counter()
    stage_data(job, data=data, source=source, svdb=svdb)
    stage_tokenize(job, tokens_dir=tokens_dir, second_lead=wants_second_lead(finetune_overrides))
    pre = stage_pretrain(job, steps=pretrain_steps, pretrainings=pretrainings, pretrain_seed=pretrain_seed)
    if pretrain_only:
        return out
    ft = stage_finetune(job, pre, seeds=seeds, finetune_examples=finetune_examples,
                        finetune_overrides=finetune_overrides)
    if train_only:
        job.timings["total"] = time.perf_counter() - t_all
        return stage_training_record(job, pre, ft)
    metrics = stage_evaluate(job, ft, retrained=any(pre.redone) or any(ft.redone), max_eval=max_eval,
                             calibration=calibration)
    job.timings["total"] = time.perf_counter() - t_all
    return stage_report(job, metrics, pre, ft, calibration=calibration)


@dataclass
class Job:
    """What the stages of one main job share; each stage fills its part.

    Attributes:
        out (Path): the job folder.
        root (Path): the folder stage stamps name paths relative to (a copy keeps its stages).
        model (str): the HLM size.
        nproc (int): CPU ranks of the training stages.
        force (bool): redo finished stages.
        db (Optional[Path]): the WFDB records (stage 1).
        described (str): the data, as the report names it.
        split_file (Optional[Path]): the split lists (None: MIT-BIH DS1/DS2).
        lists (Dict[str, Sequence[str]]): the split lists.
        extra_db (Optional[Path]): svdb's folder when its patients train too.
        tokens (Optional[Path]): the shards (stage 2).
        data (str): digest of what the models read (:func:`data_digest`).
        pretrain_data (str): the same of what the pretraining reads (token streams and beat tables).
        env (Dict[str, str]): environment of the training commands.
        common (List[str]): overrides every training command gets (shards, split, extra records).
        timings (Dict[str, Optional[float]]): wall seconds per stage (``pretrain`` / ``finetune``:
            what training cost, as recorded for a kept run; ``kept_runs``; ``total``).
    """

    out: Path
    root: Path
    model: str
    nproc: int
    force: bool
    db: Optional[Path] = None
    described: str = ""
    split_file: Optional[Path] = None
    lists: Dict[str, Sequence[str]] = field(default_factory=dict)
    extra_db: Optional[Path] = None
    tokens: Optional[Path] = None
    data: str = ""
    pretrain_data: str = ""
    env: Dict[str, str] = field(default_factory=dict)
    common: List[str] = field(default_factory=list)
    timings: Dict[str, Optional[float]] = field(default_factory=dict)


@dataclass
class Trained:
    """Runs of one training stage: folders, wall seconds (recorded for a kept run), whether redone, seeds."""

    runs: List[Path]
    seconds: List[Optional[float]]
    redone: List[bool]
    seeds: List[int]


def stage_data(job: Job, *, data: Optional[str], source: str, svdb: Optional[str]) -> None:
    """Stage 1: where the records come from, the split lists, and svdb's extra patients."""
    t0 = time.perf_counter()
    db, described, split_file = find_data(data, job.out, source)
    if split_file is None and (db / "splits.json").exists():
        split_file = db / "splits.json"
    job.lists = load_split_file(str(split_file) if split_file is not None else None)  # names the file if bad
    _say(f"data: {described}")
    job.extra_db = find_svdb(svdb, mitdb=split_file is None)
    if job.extra_db is not None:
        described += f"; extra training patients: MIT-BIH Supraventricular Arrhythmia Database ({job.extra_db}, every record)"
        _say(f"extra training patients: {job.extra_db} (svdb)")
    job.db, job.described, job.split_file = db, described, split_file
    job.timings["data"] = time.perf_counter() - t0


def wants_second_lead(finetune_overrides: Sequence[str]) -> bool:
    """Whether the fine-tunes read the second lead: the last ``dataset.second_lead=`` override, else
    the ``ecg_lora`` config's ``dataset.second_lead`` (0 or absent: no)."""
    for kv in reversed(list(finetune_overrides)):
        key, _, value = kv.partition("=")
        if key.strip() == "dataset.second_lead":
            try:
                return int(value) > 0
            except ValueError:
                return True  # not a number: tokenize the lead, the recipe's validation names the value
    import yaml

    from hlmtune.registry import resolve_config

    cfg = yaml.safe_load(resolve_config("ecg_lora").read_text()) or {}
    return bool((cfg.get("dataset") or {}).get("second_lead"))


def stage_tokenize(job: Job, *, tokens_dir: Optional[Path], second_lead: bool = False) -> None:
    """Stage 2: the shards (resumed record by record) and the digest of what the models read.

    MIT-BIH records become ``mitdb/<record>`` (a split file's database keeps its own names), svdb's
    ``svdb/<record>``, every one at the tokenizer's rate; with ``second_lead`` (the fine-tunes read
    it) each beat's window of the record's second lead too. The report of an earlier call is removed
    once the input is known good: a call that fails while training or evaluating leaves no report
    of the models it was replacing.
    """
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, RecordSource, tokenize_sources
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    t0 = time.perf_counter()
    job.tokens = Path(tokens_dir).resolve() if tokens_dir is not None else job.out / "tokens"
    records = list(job.lists["DS1"]) + list(job.lists["DS2"])
    sources = [RecordSource(job.db, "mitdb" if job.split_file is None else None, records)]
    if job.extra_db is not None:
        sources.append(RecordSource(job.extra_db, "svdb"))
    summary = tokenize_sources(sources, job.tokens, params=TokenizerParams(rr_bins=RR_BINS),
                               options=RecordOptions(second_lead=second_lead), workers=min(2, os.cpu_count() or 1),
                               progress=True)
    if not summary.ok:
        raise RuntimeError("tokenize failed for some records:\n" + summary.format())
    job.timings["tokenize"] = time.perf_counter() - t0
    (job.out / "report" / "report.md").unlink(missing_ok=True)
    (job.out / "training.json").unlink(missing_ok=True)  # likewise a train-only call's record
    # What the models learn from and are tested on, beyond the commands' paths: a changed split
    # file or re-tokenized records under the same paths redo training and evaluation.
    extra_ids = [r["record"] for r in summary.manifest["records"] if r["record"].startswith("svdb/")]
    job.data = data_digest(job.tokens, job.lists, records + extra_ids)
    job.pretrain_data = data_digest(job.tokens, job.lists, records + extra_ids, outputs=("beats", "tokens"))
    job.env = dict(os.environ)
    # One intra-op thread per rank on a CPU host (ranks x threads = cores), as torchrun does for >1 rank.
    job.env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // job.nproc))
    job.common = [f"shards_dir={job.tokens}", f"split_file={job.split_file}" if job.split_file else "split_file=null",
                  f"extra_records={'svdb' if job.extra_db is not None else 'null'}"]


def stage_pretrain(job: Job, *, steps: int, pretrainings: int, pretrain_seed: int) -> Trained:
    """Stage 3: the pretrained model(s), kept when a finished run asked the same."""
    runs = pretrain_dirs(job.out, pretrainings)
    # Pretraining p's seed; 0 keeps the config's own seed (model initialization and window
    # order), so that command, and with it a kept run, is what it was before --pretrain-seed.
    seeds = [pretrain_seed + p for p in range(pretrainings)]
    stride, pre_steps = pretrain_schedule(steps, job.tokens, job.split_file, job.nproc,
                                          extra_records="svdb" if job.extra_db is not None else None)
    if pre_steps < steps:
        _say(f"warning: --pretrain-steps {steps} > the {pre_steps} steps one epoch holds even with "
             f"windows every {stride or 'max_seq_len'} tokens ({MAX_WINDOW_OVERLAP}-fold overlap, the most this "
             "takes): pretraining stops at the end of that epoch; more data gives more steps")
    # The stride only when one is set: a rerun of an earlier job's command keeps its pretrained model.
    over = [*job.common, f"model._component_=hlmtune.hlm.model.{job.model}", f"max_steps_per_epoch={pre_steps}",
            *([f"dataset.stride={stride}"] if stride else [])]
    windows = "" if not stride else f" (windows every {stride} tokens" + (
        ", so that one epoch holds them)" if pre_steps == steps else ")")
    done = Trained(runs, [], [], seeds)
    for p, (run, s) in enumerate(zip(runs, seeds)):
        took, ran = _train_stage(
            "pretrain" + (f" (seed {s})" if s else ""), run, run / "epoch_0" / "model.pt", job.force, job.env,
            f"pretraining {job.model} for {pre_steps} steps on {job.nproc} CPU rank(s){windows}"
            + (f", seed {s}" if s else "") + (f" ({p + 1} of {pretrainings})" if pretrainings > 1 else ""),
            _train_cmd(job.nproc, "full_finetune_distributed", "ecg_pretrain", [*over, *([f"seed={s}"] if s else [])], run),
            root=job.root, data=job.pretrain_data,
        )
        done.seconds.append(took)
        done.redone.append(ran)
    job.timings["pretrain"] = _total(done.seconds)
    return done


def stage_finetune(job: Job, pre: Trained, *, seeds: int, finetune_examples: int,
                   finetune_overrides: Sequence[str]) -> Trained:
    """Stage 4: the LoRA fine-tune(s); fine-tune k starts from pretraining k mod P (redone when it was)."""
    p = len(pre.runs)
    # The names of P = 1 stay as they were (reruns keep them).
    runs = [job.out / "runs" / ("lora" if k == 0 else f"lora_seed{k}" if k % p == 0 else f"lora_seed{k}_pre{k % p}")
            for k in range(seeds)]
    examples = examples_trained(finetune_examples, finetune_overrides)  # what each fine-tune draws, for its message
    done = Trained(runs, [], [], list(range(seeds)))
    for k, run in enumerate(runs):
        seed = [f"seed={k}", f"dataset.seed={k}"] if k else []  # seed 0: the config's own (one model unchanged by --seeds)
        src = k % p
        took, ran = _train_stage(
            "fine-tune" + (f" (seed {k})" if k else ""), run, run / "epoch_0" / "model-00001-of-00001.bin",
            job.force or pre.redone[src], job.env,
            f"LoRA fine-tuning for beat classes on {examples} training examples"
            + (f", seed {k} ({k + 1} of {seeds})" if seeds > 1 else ""),
            _train_cmd(job.nproc, "lora_finetune_distributed", "ecg_lora",
                       [*job.common, f"model._component_=hlmtune.hlm.model.lora_{job.model}",
                        f"pretrain_dir={pre.runs[src]}", f"dataset.num_examples={finetune_examples}", *seed,
                        *finetune_overrides], run),
            root=job.root, data=job.data,
        )
        done.seconds.append(took)
        done.redone.append(ran)
    job.timings["finetune"] = _total(done.seconds)
    job.timings["kept_runs"] = sum(not r for r in (*pre.redone, *done.redone))
    return done


def stage_training_record(job: Job, pre: Trained, ft: Trained) -> Path:
    """Instead of stages 5-6 (``train_only``): ``training.json`` in the job folder, the stages' wall
    times (``timings``, as ``report/timings.json`` has them) and each run's folder and seconds;
    returns its path. The test split is not read."""
    from hlmtune.files import atomic_write_text

    record = {"timings": job.timings, "test_split_read": False,
              "runs": [{"stage": stage, "run": str(run), "seed": seed, "seconds": s, "kept": not redone}
                       for stage, t in (("pretrain", pre), ("finetune", ft))
                       for run, seed, s, redone in zip(t.runs, t.seeds, t.seconds, t.redone)]}
    path = job.out / "training.json"
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def stage_evaluate(job: Job, ft: Trained, *, retrained: bool, max_eval: Optional[int],
                   calibration: Optional[Path]) -> Dict[str, Any]:
    """Stage 5: the test split through the fine-tune(s) (an ensemble of several), kept on a rerun
    when no model changed and it was asked the same way."""
    from hlmtune.files import atomic_write_text
    from hlmtune.hlm.evaluate import evaluate, load_run_config

    t0 = time.perf_counter()
    report = job.out / "report"
    eval_stamp = report / STAGE_STAMP
    run_paths = [str(r) for r in ft.runs]
    cal = str(Path(calibration).resolve()) if calibration else None
    asked = {"format": EVAL_FORMAT, "data": job.data, "runs": portable(run_paths, job.root), "max_eval": max_eval,
             "calibration": portable([cal], job.root)[0] if cal else None,
             "calibration_file": Path(calibration).read_text() if calibration and Path(calibration).is_file() else None}
    absolute = {**asked, "runs": run_paths, "calibration": cal}  # the stamp of an older version (accepted in place)
    if (not job.force and not retrained and (report / "metrics.json").is_file() and (report / "predictions.npz").is_file()
            and eval_stamp.is_file() and json.loads(eval_stamp.read_text()) in (asked, absolute)):
        _say(f"evaluation: finished before with these models, kept ({report}; --force redoes it)")
        metrics = json.loads((report / "metrics.json").read_text())
    else:
        # A split file's test list is keyed DS2 whatever it holds (a cv fold's held-out patients)
        test_set = "DS2" if job.split_file is None else f"the test records (\"DS2\" list) of {job.split_file}"
        _say(f"evaluating on {test_set} (unseen patients)"
             + (f": an ensemble of the {len(ft.runs)} fine-tuned runs" if len(ft.runs) > 1 else ""))
        eval_stamp.unlink(missing_ok=True)
        cfg = load_run_config(str(ft.runs[0]), [])
        # ~50k DS2 beats x ~150 tokens: compiling once (about a minute) saves more than it costs.
        metrics = evaluate(cfg, out_dir=report, max_examples=max_eval, compile=max_eval is None or max_eval >= 10_000,
                           ensemble=ft.runs[1:], calibration=calibration)
        atomic_write_text(eval_stamp, json.dumps(asked, indent=1) + "\n")
    job.timings["evaluate"] = time.perf_counter() - t0
    return metrics


def stage_report(job: Job, metrics: Dict[str, Any], pre: Trained, ft: Trained, *,
                 calibration: Optional[Path]) -> Path:
    """Stage 6: ``report/report.md`` (results, baselines, per record and timing, training, wall
    time), the training plots and ``timings.json``; returns the report's path."""
    from hlmtune.files import atomic_write_text
    from hlmtune.hlm.report import job_report_markdown

    report = job.out / "report"
    runs = {**{"pretrain" + (f" seed {s}" if s else ""): _steps(r) for r, s in zip(pre.runs, pre.seeds)},
            **{"LoRA fine-tune" + (f" seed {k}" if k else ""): _steps(r) for k, r in enumerate(ft.runs)}}
    plots = plot_training(runs, report)
    training = [_stage_summary(name, steps, t, kept=not r)
                for (name, steps), t, r in zip(runs.items(), [*pre.seconds, *ft.seconds], [*pre.redone, *ft.redone])]
    text = job_report_markdown(
        metrics, described=job.described, model=job.model, nproc=job.nproc, seeds=len(ft.runs),
        pretrain_seeds=pre.seeds, calibration=calibration, mitdb=job.split_file is None, training_rows=training,
        plots=plots, timings=job.timings, runs=[*pre.runs, *ft.runs])
    atomic_write_text(report / "report.md", text)
    atomic_write_text(report / "timings.json", json.dumps(job.timings, indent=1) + "\n")
    return report / "report.md"


def register(subparsers: Any) -> None:
    """Add ``hlmtune demo``."""
    p = subparsers.add_parser(
        "demo",
        help="the main job: ECG records -> tokens -> pretrain -> LoRA -> eval on unseen patients -> report",
        description=(
            "Build a Heart Language Model end to end: MIT-BIH (from --data or $HLM_DATA/mitdb; else downloaded "
            "when online; else synthetic ECG, named as such), tokenize, pretrain from scratch, LoRA fine-tune "
            "for beat classes on DS1, evaluate on DS2 (unseen patients), and write report.md with loss curves, "
            "iteration time, peak memory, the confusion matrix, the published baselines and a per-record table "
            "(which patients the errors come from). Finished stages are "
            "kept on rerun (--force redoes them), also in a copy of the --out folder (cp -r outputs/demo "
            "outputs/demo_b, then --out outputs/demo_b with other settings redoes only what they change). "
            "The tiny LoRA scaling demo is `hlmtune scaling-demo`."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    add_job_arguments(p, out="outputs/demo", each="")
    p.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                   help="class-bias file of `hlmtune cv` (fitted on DS1 out-of-fold predictions), applied in the "
                        "evaluation; the uncalibrated figures are reported beside it")
    p.set_defaults(func=_main)


def add_job_arguments(p: argparse.ArgumentParser, *, out: str, each: str) -> None:
    """The flags ``hlmtune demo`` and ``hlmtune cv`` share (``each``: " per fold" for cv)."""
    p.add_argument("--out", default=out, help="output folder")
    p.add_argument("--data", default=None, help="WFDB folder (MIT-BIH, or a database with splits.json)")
    p.add_argument("--source", default="auto", choices=("auto", "mitdb", "download", "synthetic"),
                   help="where records come from when --data is not given")
    p.add_argument("--svdb", default="auto", metavar="DIR|auto|none",
                   help="extra training patients: the MIT-BIH Supraventricular Arrhythmia Database (auto: $HLM_DATA/svdb "
                        "when present and the data is MIT-BIH; none: DS1 only). Never a test patient")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks for training")
    p.add_argument("--model", default="hlm_1m", help="hlm_1m, hlm_10m or hlm_100m")
    p.add_argument("--pretrain-steps", type=int, default=PRETRAIN_STEPS,
                   help=f"pretraining steps{each} (8 x 512 tokens per rank each; more than an epoch of "
                        "packed windows (~800 on DS1 at 2 ranks) start the windows closer together, so that one "
                        "epoch holds them)")
    p.add_argument("--finetune-examples", type=int, default=FINETUNE_EXAMPLES, help=f"LoRA fine-tuning examples from the training records{each}")
    p.add_argument("--seeds", type=int, default=1,
                   help=f"LoRA fine-tunes{each} with seeds 0..K-1, evaluated as one ensemble (each adds a fine-tune "
                        "and an evaluation pass, ~5 min with MIT-BIH on 2 cores)")
    p.add_argument("--pretrainings", type=int, default=1,
                   help=f"pretrained models{each} with seeds S..S+P-1 (S: --pretrain-seed; P: 1..--seeds); fine-tune k "
                        "starts from pretraining k mod P, so the ensemble's members differ in pretraining too (each adds a pretraining, "
                        "~6 min with MIT-BIH on 2 cores at 600 steps)")
    p.add_argument("--pretrain-seed", type=int, default=0,
                   help="seed of the first pretraining (pretraining p has seed S+p): another value gives another "
                        "set of pretrained models on the same data, to check that a fine-tuning setting's effect is "
                        "not one set's luck; fine-tune seeds stay 0..K-1")
    p.add_argument("--max-eval", type=int, default=None, help=f"evaluate only the first N test beats{each} (smoke runs)")
    p.add_argument("--force", action="store_true", help="redo finished stages")


# Bad input of a job (its data, its flags' values, its output folder): one line, exit 2.
JOB_INPUT_ERRORS = (OutputPathError, FileNotFoundError, SplitError, ValueError)


def job_flag_error(args: argparse.Namespace) -> Optional[str]:
    """The first of the job's numeric flags out of range, as a message; None when all are in range.

    Args:
        args (argparse.Namespace): ``nproc``, ``pretrain_steps``, ``finetune_examples``, ``seeds``,
            ``pretrainings``, ``pretrain_seed`` and (optional) ``max_eval``.
    """
    for flag, v, least in (("--nproc", args.nproc, 1), ("--pretrain-steps", args.pretrain_steps, 1),
                           ("--finetune-examples", args.finetune_examples, 1), ("--seeds", args.seeds, 1),
                           ("--pretrainings", args.pretrainings, 1), ("--pretrain-seed", args.pretrain_seed, 0),
                           ("--max-eval", getattr(args, "max_eval", None), 1)):
        if v is not None and v < least:  # --max-eval None: every test beat
            return f"{flag} must be >= {least}, got {v}"
    return pretrainings_error(args.pretrainings, args.seeds)


def pretrainings_error(pretrainings: int, seeds: int) -> Optional[str]:
    """Why ``--pretrainings`` does not fit ``--seeds`` (each pretrained model needs a fine-tune), or None."""
    if not 1 <= pretrainings <= seeds:
        return f"--pretrainings must be 1..--seeds ({seeds}): each pretrained model needs a fine-tune, got {pretrainings}"
    return None


def run_job(prog: str, args: argparse.Namespace, job: Any) -> int:
    """Check the shared flags, run ``job()`` (returns the report path) and map errors to exit codes.

    Returns:
        int: 0 (the report path printed last), 2 (bad input: one line) or 1 (a stage failed).
    """
    bad = job_flag_error(args)
    if bad:
        print(f"hlmtune {prog}: {bad}", file=sys.stderr)
        return 2
    status, report = exit_status(prog, job)
    if status == 0:
        print(f"report: {report}")
    return status


def exit_status(prog: str, job: Any) -> Tuple[int, Any]:
    """Run ``job()``: ``(0, its result)``, or the error as one line and ``(2, None)`` for bad input
    (:data:`JOB_INPUT_ERRORS`), ``(1, None)`` for a failed stage (``RuntimeError``)."""
    try:
        return 0, job()
    except JOB_INPUT_ERRORS as e:
        status, message = 2, str(e)
    except RuntimeError as e:
        status, message = 1, str(e)
    print(f"hlmtune {prog}: {message}", file=sys.stderr)
    return status, None


def _main(args: argparse.Namespace) -> int:
    return run_job("demo", args, lambda: run_pipeline(
        out=Path(args.out), data=args.data, source=args.source, nproc=args.nproc, pretrain_steps=args.pretrain_steps,
        finetune_examples=args.finetune_examples, max_eval=args.max_eval, model=args.model, force=args.force,
        seeds=args.seeds, calibration=args.calibration, pretrainings=args.pretrainings,
        pretrain_seed=args.pretrain_seed, svdb=args.svdb))
