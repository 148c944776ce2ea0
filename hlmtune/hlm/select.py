"""``hlmtune select``: run a model-selection plan of ``hlmtune cv`` candidates, in order, by its rule.

A plan (YAML, written before its runs) names a baseline, an ordered list of candidate settings
and the adoption rule (docs/hlm.md: a candidate replaces the baseline when its pooled ensemble
figure is at least ``min_gain`` above the baseline's and at least ``min_folds`` folds are at or
above the baseline's; the figure is macro-F1 unless ``rule.figure`` names another of
:data:`hlmtune.hlm.cv.FIGURES`, e.g. ``sv_f1``, the mean of S and V F1)::

    cv: [--folds, "4", --seeds, "3"]           # flags of every `hlmtune cv` run of the plan
    env: {HLM_ONEDNN_LINEAR: "0"}              # environment of every run
    rule: {min_gain: 0.015, min_folds: 3}       # figure: macro_f1 (default) or sv_f1
    fixed: [dataset.normalized_rr=256]          # overrides every run reads first (optional)
    baseline: {overrides: []}
    candidates:
      - {name: examples36k, overrides: [dataset.num_examples=36000], why: "..."}
      - {name: pretrain1200, flags: [--pretrain-steps, "1200"]}

The job folder ``--out`` holds ``baseline/`` (the baseline's ``hlmtune cv`` folder), one folder
per candidate, ``verdicts.jsonl`` (one row per judged candidate, appended as each is judged) and
``plan.md`` (every verdict so far and the settings the plan has adopted). Each candidate runs on a
copy of the current baseline's folder (the same folds and, unless it changes the pretraining, the
same pretrained models) with ``--baseline`` and ``--need-folds min_folds``, so a candidate that
cannot meet the fold count stops early. An adopted candidate's folder becomes the baseline, and
its overrides and flags join every later candidate's command. ``fixed`` overrides come first in
every run's command (a key a run sets itself is left out of them): the settings the configs
shipped when the plan was written, so that the plan replays as it ran after the configs change
(a plan whose candidate is adopted into the configs would otherwise re-make its baseline as the
candidate). A rerun resumes: judged candidates are read back from ``verdicts.jsonl`` (and
checked against the plan: a plan changed after a verdict is refused), a cut ``hlmtune cv`` keeps
its finished stages. A plan file edited while its job runs, so that it parses to other runs or
another rule, stops the job before its next candidate (a job holds the plan it read; comments and
the description do not count). DS2 is never read.

``--record REC`` keeps the plan's small files (``verdicts.jsonl``, ``plan.md`` and each finished
run's ``cv_metrics.json`` / ``cv_stopped.json`` / ``report.md``, no model) in a second folder, written
after every run and read first to seed ``--out``: committed to git, it carries a plan across
machines that do not keep ``--out``. The same settings computed on another CPU kind differ, so a
baseline whose folder holds its result but not the pretrained models the result names (another
machine's record, stages lost) is checked first: ``hlmtune cv --check-pretraining`` pretrains its
fold 1 in ``<baseline>.pretrain_check`` and compares the checkpoint's digest with the recorded
one. The same bytes: the recorded figures stand. Other bytes, no digest, or no result: the
baseline is re-made on this machine with its own settings (an adopted candidate without
``--baseline``: its verdict stands) before the next candidate runs against it, starting from the
check's fold-1 pretraining (kept when its stage stamp matches the re-make's), and the record
keeps the result it replaced in ``REC/hosts/<digest>/<run>/``: a later host whose fold 1 pretrains
to that digest takes it back instead of re-making it. Each verdict row
counts the folds whose pretrained models have the baseline's bytes (``same_pretraining``).

``--interleave`` makes a baseline that has to be made (none yet, or one re-made on this host) fold
by fold beside the next candidate instead of first and whole: the baseline's cv through fold k
(``hlmtune cv --through-fold k``), its fold-k pretrained models copied to the candidate, the
candidate through fold k against that unfinished baseline with ``--need-folds``, then k + 1. A
candidate the fold count rejects after two folds then costs two folds of each (about 1.7 hours on
2 CPU cores) instead of the whole baseline and two folds (about 2.7 hours); one that is not rejected
ends with both runs finished and is judged as without it. Same verdicts, same commands per fold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from hlmtune.hlm.cv import FIGURES, figure_of, fold_progress_in, other_bytes_hint
from hlmtune.proc import child_dies_with_us
from hlmtune.training.options import closest

PLANS_DIR = Path(__file__).parent / "plans"
PLAN_KEYS = ("description", "cv", "env", "rule", "fixed", "baseline", "candidates")
RULE_KEYS = ("min_gain", "min_folds", "figure")
RUN_KEYS = ("name", "overrides", "flags", "why")
# flags the driver sets itself: a plan naming them would judge against the wrong folder, or by
# another figure than its rule's (``--figure`` comes from ``rule.figure``)
OWNED_FLAGS = ("--out", "--baseline", "--need-folds", "--figure", "--check-pretraining", "--through-fold")
CHECK_SUFFIX = ".pretrain_check"  # ``<baseline>.pretrain_check``: where a recorded baseline's fold 1 is pretrained
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# what ``--record`` keeps of each run: the figures and the report, none of the stages
RECORD_FILES = ("cv_metrics.json", "cv_stopped.json", "report.md")
RESULTS = ("cv_metrics.json", "cv_stopped.json")
# ``REC/hosts/<digest>/<run>/``: a run's small files as another host made them (one whose fold 1
# pretrains to ``<digest>``), kept when a run is re-made on a host that computes otherwise, so a
# plan can go on on either kind of host without re-making its baseline there again
HOSTS = "hosts"
Runner = Callable[[List[str], Dict[str, str], Path], int]


def _say(msg: str) -> None:
    print(f"[hlmtune select] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Setting:
    """One run of a plan: ``hlmtune cv`` flags and fine-tuning overrides (``key=value``)."""

    name: str
    overrides: Tuple[str, ...] = ()
    flags: Tuple[str, ...] = ()
    why: str = ""

    def words(self) -> str:
        """The setting as one line (flags, then overrides), ``shipped`` when it has neither."""
        return " ".join((*self.flags, *self.overrides)) or "shipped"


@dataclass(frozen=True)
class Plan:
    """A parsed plan file (:func:`load_plan`)."""

    source: Path
    cv: Tuple[str, ...]
    env: Dict[str, str]
    min_gain: float
    min_folds: int
    baseline: Setting
    candidates: Tuple[Setting, ...]
    description: str = ""
    figure: str = "macro_f1"  # what min_gain and min_folds judge: a key of hlmtune.hlm.cv.FIGURES
    fixed: Tuple[str, ...] = ()  # overrides of every run, before its own (the configs as the plan was written)

    @property
    def figure_words(self) -> str:
        """The rule's figure as reports name it."""
        return FIGURES[self.figure]


def _check_keys(where: str, mapping: Any, allowed: Sequence[str]) -> Dict[str, Any]:
    if not isinstance(mapping, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(mapping).__name__}")
    for key in mapping:
        if key not in allowed:
            raise ValueError(f"{where}: unknown key {key!r}{closest(str(key), allowed)}; known: {', '.join(allowed)}")
    return mapping


def _words(where: str, value: Any) -> Tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise ValueError(f"{where}: expected a list of strings, got {value!r}")
    return tuple(str(v) for v in value)


def _setting(where: str, raw: Any, *, name: Optional[str] = None) -> Setting:
    raw = _check_keys(where, raw, RUN_KEYS)
    name = name or raw.get("name")
    if (not isinstance(name, str) or not NAME.match(name) or name in ("baseline", HOSTS)
            or name.endswith(CHECK_SUFFIX)):
        raise ValueError(f"{where}.name: a folder name (letters, digits, _ . -; not 'baseline' or {HOSTS!r}, not "
                         f"ending in {CHECK_SUFFIX!r}), got {name!r}")
    overrides = _overrides(f"{where}.overrides", raw.get("overrides"))
    flags = _words(f"{where}.flags", raw.get("flags"))
    _check_flags(f"{where}.flags", flags)
    return Setting(name=name, overrides=overrides, flags=flags, why=str(raw.get("why", "")))


def _overrides(where: str, value: Any) -> Tuple[str, ...]:
    overrides = _words(where, value)
    for o in overrides:
        if "=" not in o or o.startswith("-"):
            raise ValueError(f"{where}: {o!r} is not key=value (cv flags go under 'flags')")
    return overrides


def _check_flags(where: str, flags: Sequence[str]) -> None:
    if flags and not flags[0].startswith("--"):
        raise ValueError(f"{where}: starts with {flags[0]!r}, not a --flag")
    for f in flags:
        if f.split("=")[0] in OWNED_FLAGS:
            raise ValueError(f"{where}: {f.split('=')[0]} is set by hlmtune select itself")


def _flag_value(flags: Sequence[str], flag: str, default: int) -> int:
    value = default
    for i, f in enumerate(flags):
        if f == flag and i + 1 < len(flags):
            value = int(flags[i + 1])
        elif f.startswith(flag + "="):
            value = int(f.split("=", 1)[1])
    return value


def load_plan(path: Path) -> Plan:
    """Read and check a plan file.

    Args:
        path (Path): the YAML plan (:data:`PLANS_DIR` holds the packaged ones).

    Returns:
        Plan: the plan, every list as tuples.

    Raises:
        ValueError: a malformed plan, naming the file and the key (with the closest known key for
            a typo), a duplicate candidate name, a rule outside its range, or a flag the driver owns.
    """
    where = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not YAML: {e}".splitlines()[0]) from e
    raw = _check_keys(where, raw, PLAN_KEYS)
    rule = _check_keys(f"{where}: rule", raw.get("rule", {}), RULE_KEYS)
    cv = _words(f"{where}: cv", raw.get("cv"))
    _check_flags(f"{where}: cv", cv)
    env = raw.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, (str, int)) for k, v in env.items()):
        raise ValueError(f"{where}: env: expected NAME: value strings, got {env!r}")
    cands = raw.get("candidates")
    if not isinstance(cands, list) or not cands:
        raise ValueError(f"{where}: candidates: expected a non-empty list of {{name, overrides, flags}}")
    candidates = tuple(_setting(f"{where}: candidates[{i}]", c) for i, c in enumerate(cands))
    names = [c.name for c in candidates]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where}: candidates: the name {dup[0]!r} is used twice (each names a folder)")
    empty = [c.name for c in candidates if not c.overrides and not c.flags]
    if empty:
        raise ValueError(f"{where}: candidates: {empty[0]!r} has neither overrides nor flags (it is the baseline)")
    folds = _flag_value(cv, "--folds", 4)
    min_gain, min_folds = rule.get("min_gain", 0.015), rule.get("min_folds", folds)
    if not isinstance(min_gain, (int, float)) or isinstance(min_gain, bool):
        raise ValueError(f"{where}: rule.min_gain: a number, got {min_gain!r}")
    if not isinstance(min_folds, int) or not 1 <= min_folds <= folds:
        raise ValueError(f"{where}: rule.min_folds: between 1 and the plan's {folds} folds, got {min_folds!r}")
    figure = rule.get("figure", "macro_f1")
    if figure not in FIGURES:
        raise ValueError(f"{where}: rule.figure: {figure!r} is not a figure{closest(str(figure), list(FIGURES))}; "
                         f"known: {', '.join(FIGURES)}")
    fixed = _overrides(f"{where}: fixed", raw.get("fixed"))
    return Plan(figure=figure, fixed=fixed, source=Path(path), cv=cv, env={k: str(v) for k, v in env.items()},
                min_gain=float(min_gain), min_folds=min_folds,
                baseline=_setting(f"{where}: baseline", raw.get("baseline") or {}, name="base"), candidates=candidates,
                description=str(raw.get("description", "")).strip())


def resolve_plan(name: str) -> Path:
    """A plan file: a path, or the stem of a packaged plan (``hlm_61_patients``)."""
    path = Path(name)
    if path.is_file():
        return path
    packaged = {p.stem: p for p in sorted(PLANS_DIR.glob("*.yaml"))}
    if name in packaged:
        return packaged[name]
    raise ValueError(f"no plan file {name!r}{closest(name, list(packaged))}; packaged plans: {', '.join(packaged)}")


def verdict(run_dir: Path, base_dir: Path, plan: Plan) -> Dict[str, Any]:
    """Judge a finished candidate by the plan's rule from its ``hlmtune cv`` folder.

    Args:
        run_dir (Path): the candidate's folder (``cv_metrics.json``, or ``cv_stopped.json`` when
            ``--need-folds`` stopped it).
        base_dir (Path): the baseline folder it was run against (checked against the file's own).
        plan (Plan): the rule.

    Returns:
        Dict: ``adopted``, ``figure`` (the rule's), ``pooled_macro_f1`` / ``baseline_macro_f1``
        (None when stopped), ``pooled_figure`` (this run, baseline: the rule's figure; None when
        stopped), ``pooled_delta`` (of the rule's figure; None when stopped),
        ``folds_at_or_above``, ``fold_deltas`` (of the rule's figure), ``stopped_after_fold`` (None
        when every fold ran), ``s_f1`` / ``v_f1`` (this run, baseline; None when stopped),
        ``same_pretraining`` (folds whose pretrained models have the baseline's checkpoint bytes;
        None when unknown).

    Raises:
        ValueError: neither file exists, the run was judged against another baseline, or by
            another figure than the rule's.
    """
    stopped, done = run_dir / "cv_stopped.json", run_dir / "cv_metrics.json"
    # files written before cv named its figure judged by macro-F1, in "delta"
    delta = lambda f: f.get("figure_delta", f.get("delta"))  # noqa: E731
    if stopped.exists():
        doc = json.loads(stopped.read_text())
        _same_baseline(doc["baseline"], base_dir, stopped)
        _same_figure(doc, plan, stopped)
        deltas = [delta(f) for f in doc["folds"]]
        return {"adopted": False, "figure": plan.figure, "pooled_macro_f1": None, "baseline_macro_f1": None,
                "pooled_figure": None, "pooled_delta": None,
                "folds_at_or_above": sum(d >= 0 for d in deltas), "fold_deltas": deltas,
                "stopped_after_fold": doc["folds_run"], "s_f1": None, "v_f1": None,
                "same_pretraining": _count_same([f.get("same_pretraining") for f in doc["folds"]])}
    if not done.exists():
        raise ValueError(f"{run_dir}: no cv_metrics.json or cv_stopped.json (the hlmtune cv run did not finish)")
    cmp = json.loads(done.read_text()).get("baseline")
    if cmp is None:
        raise ValueError(f"{done}: run without --baseline, so it cannot be judged")
    _same_baseline(cmp["source"], base_dir, done)
    _same_figure(cmp, plan, done)
    pooled, deltas = cmp["pooled"], [delta(f) for f in cmp["folds"]]
    f1 = lambda c: [pooled["f1"][c]["this"], pooled["f1"][c]["baseline"]] if c in pooled["f1"] else None  # noqa: E731
    return {"adopted": delta(pooled) >= plan.min_gain and cmp["folds_at_or_above"] >= plan.min_folds,
            "figure": plan.figure, "pooled_macro_f1": pooled["macro_f1"], "baseline_macro_f1": pooled["baseline"],
            "pooled_figure": [pooled.get("figure_this", pooled["macro_f1"]),
                              pooled.get("figure_baseline", pooled["baseline"])],
            "pooled_delta": delta(pooled), "folds_at_or_above": cmp["folds_at_or_above"], "fold_deltas": deltas,
            "stopped_after_fold": None, "s_f1": f1("S"), "v_f1": f1("V"),
            "same_pretraining": _count_same([f.get("same_pretraining") for f in cmp["folds"]])}


def _count_same(flags: Sequence[Optional[bool]]) -> Optional[int]:
    """Folds known to share the baseline's pretrained models; None when no fold is known."""
    return None if all(v is None for v in flags) else sum(v is True for v in flags)


def _same_figure(doc: Dict[str, Any], plan: Plan, where: Path) -> None:
    judged = doc.get("figure", "macro_f1")
    if judged != plan.figure:
        raise ValueError(f"{where}: judged by {judged}, but the plan's rule judges by {plan.figure}")


def _same_baseline(source: str, base_dir: Path, where: Path) -> None:
    src = Path(source).resolve()
    if src not in (base_dir.resolve(), (base_dir / "cv_metrics.json").resolve()):
        raise ValueError(f"{where}: judged against {source}, but the plan's baseline here is {base_dir}")


def run_process(cmd: List[str], env: Dict[str, str], log: Path) -> int:
    """Run one ``hlmtune cv`` with its output appended to ``log``; returns its exit status.

    Every byte goes to the log as it comes (progress bars' carriage returns included); cv's line at
    the end of each fold is also echoed on select's stderr, so a plan's own output says how a
    candidate stands between its verdicts (hours apart on 2 cores).
    """
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        # a killed select (kill PID, no handler runs) takes its cv, and cv its stages, along
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=child_dies_with_us())
        try:
            for line in proc.stdout:  # type: ignore[union-attr]  # split at \n only: a bar's \r stays in its line
                f.write(line)
                f.flush()
                fold = fold_progress_in(line.decode(errors="replace"))
                if fold is not None:
                    _say(f"{log.stem}: {fold}")
            return proc.wait()
        except BaseException:  # as subprocess.run does: an interrupted select leaves no cv behind
            proc.kill()
            proc.wait()
            raise


def cv_command(plan: Plan, out: Path, setting: Setting, carried: Setting, base: Optional[Path],
               extra: Sequence[str] = ()) -> List[str]:
    """The ``hlmtune cv`` command of one run: plan flags, adopted then own flags, ``extra``, then the
    plan's fixed overrides (those whose key the run does not set), adopted, own overrides."""
    cmd = [sys.executable, "-m", "hlmtune.cli", "cv", "--out", str(out), *plan.cv, *carried.flags, *setting.flags,
           *extra]
    if base is not None:
        cmd += ["--baseline", str(base), "--need-folds", str(plan.min_folds)]
        if plan.figure != "macro_f1":  # the default's commands stay as plans before rule.figure ran them
            cmd += ["--figure", plan.figure]
    own = [*carried.overrides, *setting.overrides]
    keys = {o.split("=", 1)[0] for o in own}
    return [*cmd, *(o for o in plan.fixed if o.split("=", 1)[0] not in keys), *own]


def _copy_of(base: Path, dest: Path) -> None:
    """``dest`` as a copy of the baseline's folder, complete or absent (copied beside, then renamed)."""
    if dest.exists():
        return
    tmp = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, symlinks=True)
    tmp.rename(dest)


def _read_verdicts(path: Path) -> Dict[str, Dict[str, Any]]:
    rows: Dict[str, Dict[str, Any]] = {}
    if path.exists():
        for i, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: row {i} is not JSON ({e.msg}): remove it and rerun") from e
            rows[row["name"]] = row
    return rows


def _check_row(row: Dict[str, Any], plan: Plan, cand: Setting, carried: Setting, path: Path) -> None:
    planned = {"overrides": list(cand.overrides), "flags": list(cand.flags),
               "carried": [*carried.flags, *carried.overrides], "figure": plan.figure}
    ran = {k: row.get(k) for k in planned}
    ran["figure"] = row.get("figure", "macro_f1")  # rows written before rule.figure: macro-F1
    if ran != planned:
        raise ValueError(f"{path}: {cand.name!r} was judged with {ran}, the plan now says {planned}: a plan is "
                         "written before its runs (start a new --out for a new plan)")


def _append(path: Path, row: Dict[str, Any]) -> None:
    with open(path, "a") as f:  # one whole line per verdict, on disk before the next candidate starts
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _run(name: str, cmd: List[str], env: Dict[str, str], log: Path, runner: Runner) -> float:
    _say(f"{name}: hlmtune cv ... (log: {log})")
    t0 = time.time()
    rc = runner(cmd, env, log)
    if rc != 0:
        raise RuntimeError(f"{name}: hlmtune cv exited with {rc}; its output is in {log} (a rerun resumes)")
    return time.time() - t0


def _has_result(run: Path) -> bool:
    return any((run / name).exists() for name in RESULTS)


def seed_from_record(record: Path, out: Path) -> None:
    """Copy into ``out`` what a ``--record`` folder holds and ``out`` lacks.

    Verdict rows are merged by name (a name in both with different rows is refused); a run whose
    folder in ``out`` has no result gets the record's files (its stages, if any, stay).

    Raises:
        ValueError: the two verdict files disagree about a candidate, or a run has another result
            in ``out`` than in the record (both files named).
    """
    if not record.is_dir():
        return
    from hlmtune.files import atomic_write_bytes

    theirs, ours = _read_verdicts(record / "verdicts.jsonl"), _read_verdicts(out / "verdicts.jsonl")
    for name in sorted(set(theirs) & set(ours)):
        if theirs[name] != ours[name]:
            raise ValueError(f"{record / 'verdicts.jsonl'} and {out / 'verdicts.jsonl'} judge {name!r} differently: "
                             "keep the right one and remove the other's row")
    extra = [row for name, row in theirs.items() if name not in ours]
    if extra:
        merged = [*ours.values(), *extra]
        atomic_write_bytes(out / "verdicts.jsonl", "".join(json.dumps(r) + "\n" for r in merged).encode())
    for run in sorted(d for d in record.iterdir() if d.is_dir() and _has_result(d)):
        if _has_result(out / run.name):
            for name in RESULTS:
                if (run / name).exists() and (run / name).read_bytes() != _bytes(out / run.name / name):
                    raise ValueError(f"{out / run.name / name} is not {run / name}: this job folder ran {run.name!r} "
                                     "apart from the record's (one record per job folder)")
            continue
        for name in RECORD_FILES:
            if (run / name).exists():
                atomic_write_bytes(out / run.name / name, (run / name).read_bytes())


def _bytes(path: Path) -> Optional[bytes]:
    return path.read_bytes() if path.exists() else None


def _copy_files(src: Path, dest: Path) -> None:
    """Make ``dest``'s :data:`RECORD_FILES` those of ``src`` (each atomically; one ``src`` lacks is removed)."""
    from hlmtune.files import atomic_write_bytes

    for name in RECORD_FILES:
        if (src / name).exists():
            atomic_write_bytes(dest / name, (src / name).read_bytes())
        else:
            (dest / name).unlink(missing_ok=True)


def export_record(record: Path, out: Path, runs: Sequence[str]) -> None:
    """Write ``verdicts.jsonl``, ``plan.md`` and each finished run's small files into ``record``.

    A recorded run whose fold 1 pretrained to other bytes than the result replacing it (made on a
    host that computes otherwise) is first kept in ``record/hosts/<its digest>/<run>``.
    """
    from hlmtune.files import atomic_write_bytes

    for run in runs:
        if not _has_result(out / run):
            continue
        theirs = _recorded_fold1(record / run)
        if theirs is not None and theirs != _recorded_fold1(out / run):
            _copy_files(record / run, record / HOSTS / theirs / run)
        _copy_files(out / run, record / run)  # a file the run lacks goes: a stopped run replaced by a finished one
    for name in ("verdicts.jsonl", "plan.md"):
        if (out / name).exists():
            atomic_write_bytes(record / name, (out / name).read_bytes())


@dataclass
class _Baseline:
    """The run the next candidate is judged against, and what made it (to re-make a lost folder)."""

    dir: Path
    setting: Setting
    carried: Setting
    unfinished: bool = False  # to be made fold by fold beside the next candidate (--interleave)

    def command(self, plan: Plan) -> List[str]:
        return cv_command(plan, self.dir, self.setting, self.carried, None)

    def check_dir(self) -> Path:
        """Where :func:`_same_host` pretrains fold 1 (beside the baseline's folder, never in it)."""
        return self.dir.with_name(self.dir.name + CHECK_SUFFIX)

    def check_command(self, plan: Plan) -> List[str]:
        return cv_command(plan, self.check_dir(), self.setting, self.carried, None,
                          ["--baseline", str(self.dir), "--check-pretraining"])


def _ensure_baseline(plan: Plan, base: _Baseline, env: Dict[str, str], out: Path, runner: Runner,
                     dry_run: bool, record: Optional[Path] = None, interleave: bool = False) -> bool:
    """Run the baseline unless its result stands here; False on a dry run.

    A result stands when its pretrained models are in its folder, or when this host pretrains
    fold 1 to the bytes the result names (:func:`_same_host`: minutes), or when the record keeps
    the run as made on a host that pretrains fold 1 to this host's bytes (:func:`_host_variant`:
    that result then replaces the other host's, here and in the record). Otherwise (no result,
    or a record from a host that computes otherwise) the baseline is re-made here with its own
    settings, so the next candidate is not judged against another machine's arithmetic (the same
    settings on another host moved a fold by 0.049: docs/hlm-experiments.md). An adopted
    candidate re-made so keeps its verdict; the re-made figures are the next baseline. With
    ``interleave`` a baseline to be made is not run here: it is marked ``unfinished`` and made fold
    by fold beside the next candidate (:func:`_judge_interleaved`).
    """
    if _has_result(base.dir):
        if _own_pretraining(base.dir):
            return True
        same = _same_host(plan, base, env, out, runner, dry_run)
        if same is None:  # a dry run: the check's command is the next one
            return False
        if same or _host_variant(record, out, base, apply=not dry_run):
            return True
    if dry_run:
        print(" ".join(base.command(plan) + (["--through-fold", "1"] if interleave else [])))
        return False
    name = base.dir.name
    if interleave:
        _say(f"{name}: to be made here, fold by fold beside the next candidate (--interleave)")
        _reuse_check_pretraining(base)
        base.unfinished = True
        return True
    _say(f"{name}: its folder holds no result or not the pretrained models its result names (another machine's "
         "record, or stages lost): re-making it here with its own settings"
         + ("" if name == "baseline" else "; its verdict stands, the re-made figures are the next baseline"))
    _reuse_check_pretraining(base)
    _run(name, base.command(plan), env, out / f"{name}.log", runner)
    return True


def _reuse_check_pretraining(base: _Baseline) -> None:
    """Put the host check's fold-1 pretraining where the re-made baseline looks for it.

    :func:`_same_host` pretrained fold 1 in ``<baseline>.pretrain_check`` with the baseline's own
    settings (minutes of work). A copy in the baseline's folder is kept by the re-make when its
    stage stamp (the command, job-relative, and the digest of the tokens and split lists it read)
    equals what the re-make would run, and redone otherwise, so nothing is trusted that the
    re-make would not have made itself. Only where the baseline's folder has no such stage yet.
    """
    from hlmtune.hlm.cv import fold_folder
    from hlmtune.hlm.pipeline import STAGE_STAMP, pretrain_dirs

    src, dest = (pretrain_dirs(fold_folder(job, 1), 1)[0] for job in (base.check_dir(), base.dir))
    if not (src / STAGE_STAMP).exists() or dest.exists():
        return
    _copy_stage(src, dest)
    _say(f"{base.dir.name}: fold 1's pretraining from the host check ({src}) copied in; the re-make keeps it "
         "if its stamp matches the re-make's own command and data")


def _copy_stage(src: Path, dest: Path) -> None:
    """Copy a stage folder to ``dest`` whole or not at all: a cut copy never looks like a finished stage."""
    tmp = dest.with_name(dest.name + ".copying")
    shutil.rmtree(tmp, ignore_errors=True)  # a copy cut short before
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, tmp)
    tmp.rename(dest)


def _host_variant(record: Optional[Path], out: Path, base: _Baseline, *, apply: bool = True) -> bool:
    """Whether ``record/hosts/<digest>/<run>`` holds the baseline as made on a host like this one.

    ``<digest>`` is what fold 1 pretrained to here (the answer :func:`_same_host` left). When that
    result is there and names the digest, it becomes (with ``apply``; a dry run changes nothing)
    the baseline's result in ``out`` and the record's (the other host's result moves to
    ``hosts/``, as :func:`export_record` keeps it).
    """
    answer = base.check_dir() / "pretrain_check.json"
    mine = json.loads(answer.read_text()).get("pretrain_sha256") if record is not None and answer.exists() else None
    kept = record / HOSTS / str(mine) / base.dir.name if mine else None
    if kept is None or not _has_result(kept) or _recorded_fold1(kept) != mine:
        return False
    if not apply:
        return True
    _copy_files(kept, base.dir)
    export_record(record, out, [base.dir.name])
    shutil.rmtree(kept)  # one copy: it is the record's run now
    if not any(kept.parent.iterdir()):
        kept.parent.rmdir()
    _say(f"{base.dir.name}: the record keeps this run as made on a host whose fold 1 pretrains to {mine}, as this "
         f"one does ({kept}): its figures stand as the baseline here")
    return True


def _recorded_fold1(run: Path) -> Optional[str]:
    """The digest of fold 1's first pretrained model that ``run``'s ``cv_metrics.json`` names."""
    path = run / "cv_metrics.json"
    folds = json.loads(path.read_text()).get("folds") if path.exists() else None
    first = folds[0] if isinstance(folds, list) and folds and isinstance(folds[0], dict) else {}
    digests = first.get("pretrain_sha256")
    return digests[0] if isinstance(digests, list) and digests else None


def _same_host(plan: Plan, base: _Baseline, env: Dict[str, str], out: Path, runner: Runner,
               dry_run: bool) -> Optional[bool]:
    """Whether this host pretrains the baseline's fold 1 to the bytes its recorded result names.

    Runs ``hlmtune cv --check-pretraining`` (fold 1's data, tokens and first pretraining, beside
    the baseline's folder) unless an earlier call left its answer for this very digest. Equal
    bytes after hundreds of steps: this host sums as the recording host did (two AMD EPYC hosts
    gave every figure of a re-made baseline alike; an Intel host gave other bytes), so the
    recorded figures stand as the baseline. Candidates then pretrain their folds here themselves,
    and their rows say in how many folds those models have the baseline's bytes.
    False where the result names no digest; None on a dry run that printed the check's command.
    """
    from hlmtune.training.fastpath import kernel_settings

    recorded = _recorded_fold1(base.dir)
    if recorded is None:
        return False
    answer = base.check_dir() / "pretrain_check.json"
    held = kernel_settings(env)  # the kernel settings the runs would get

    def read() -> Optional[Dict[str, Any]]:
        doc = json.loads(answer.read_text()) if answer.exists() else None
        # an answer for this digest under these kernel settings (none recorded: none were set)
        ok = isinstance(doc, dict) and doc.get("baseline_pretrain_sha256") == recorded
        return doc if ok and doc.get("kernels_env", {}) == held else None

    doc = read()
    if doc is None:
        if dry_run:
            print(" ".join(base.check_command(plan)))
            return None
        _say(f"{base.dir.name}: its folder holds a result but not the pretrained models it names: pretraining "
             "fold 1 here to see whether this host computes as the one that made it")
        _run(f"{base.dir.name} (fold 1's pretraining)", base.check_command(plan), env,
             out / f"{base.check_dir().name}.log", runner)
        doc = read()
        if doc is None:
            raise RuntimeError(f"{answer}: hlmtune cv --check-pretraining left no answer for digest {recorded}")
    same = doc.get("same") is True and doc.get("pretrain_sha256") == recorded
    _say(f"{base.dir.name}: fold 1 pretrains to {doc.get('pretrain_sha256')} here ({doc.get('cpu')}), {recorded} in "
         "its result: " + ("the same bytes, so its recorded figures stand as the baseline" if same else
                           "other bytes, so this host computes otherwise" + other_bytes_hint(doc)))
    return same


def _own_pretraining(run: Path) -> bool:
    """Whether every fold's pretrained models in ``run`` are the ones its ``cv_metrics.json`` names."""
    from hlmtune.hlm.cv import fold_folder, pretrain_fingerprints

    path = run / "cv_metrics.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    return all(pretrain_fingerprints(fold_folder(run, f["fold"]), int(doc.get("pretrainings", 1))) == f["pretrain_sha256"]
               for f in doc.get("folds", []) if isinstance(f, dict) and f.get("pretrain_sha256") is not None)


def run_plan(plan: Plan, out: Path, *, runner: Runner = run_process, max_candidates: Optional[int] = None,
             dry_run: bool = False, record: Optional[Path] = None, interleave: bool = False) -> List[Dict[str, Any]]:
    """Run the baseline, then each candidate not yet judged, by the plan's rule.

    Args:
        plan (Plan): the plan.
        out (Path): the job folder (``baseline/``, one folder per candidate, ``verdicts.jsonl``, ``plan.md``).
        runner (Runner): runs one ``hlmtune cv`` command (tests pass a fake).
        max_candidates (Optional[int]): judge at most this many new candidates in this call.
        dry_run (bool): print the next command instead of running anything.
        record (Optional[Path]): a folder of the plan's small files (:func:`export_record`), read
            first to seed ``out`` (:func:`seed_from_record`) and written after every run.
        interleave (bool): make a baseline that has to be made fold by fold beside the next
            candidate (:func:`_judge_interleaved`) instead of whole before it.

    Returns:
        List[Dict]: the verdict rows, in plan order (judged before or now).

    Raises:
        ValueError: a verdict file that does not match the plan (or the record's), or a run judged
            against another baseline.
        RuntimeError: an ``hlmtune cv`` run failed (its log named).
    """
    out.mkdir(parents=True, exist_ok=True)
    if record is not None:
        seed_from_record(record, out)
    env = {**os.environ, **plan.env}
    log_path = out / "verdicts.jsonl"
    done = _read_verdicts(log_path)
    base = _Baseline(out / "baseline", plan.baseline, Setting("carried"))
    carried, rows, started = plan.baseline, [], 0

    def save() -> None:
        write_summary(plan, out, rows, carried, base.dir)
        if record is not None and not dry_run:
            export_record(record, out, ["baseline", *(r["name"] for r in rows)])

    for cand in plan.candidates:
        if cand.name in done:
            row = done[cand.name]
            _check_row(row, plan, cand, carried, log_path)
        else:
            if max_candidates is not None and started >= max_candidates:
                break
            if not dry_run and _plan_changed(plan):
                _say(f"stopped before candidate {cand.name}: {plan.source} now holds another plan (its runs or "
                     f"rule changed since this job read it); rerun `hlmtune select` to go on with the plan as it is")
                break
            if not base.unfinished:  # an unfinished one goes on beside this candidate
                ready = _ensure_baseline(plan, base, env, out, runner, dry_run, record, interleave)  # dry run: printed
            else:
                ready = not dry_run
            if not ready or dry_run:
                if ready:
                    print(" ".join(cv_command(plan, out / cand.name, cand, carried, base.dir)))
                break
            save()  # the baseline's figures reach the record before a candidate can fail
            started += 1
            if base.unfinished:
                row = _judge_interleaved(plan, out, cand, carried, base, env, runner)
            else:
                row = _judge(plan, out, cand, carried, base.dir, env, runner)
        rows.append(row)
        if row["adopted"]:
            base = _Baseline(out / cand.name, cand, carried)
            carried = Setting("carried", (*carried.overrides, *cand.overrides), (*carried.flags, *cand.flags))
        save()
    return rows


def _plan_changed(plan: Plan) -> bool:
    """Whether the plan file now parses to other runs or another rule than ``plan`` (its description
    and YAML comments, where verdicts get noted while a job runs, do not count; a file that no longer
    parses does)."""
    try:
        now = load_plan(plan.source)
    except (OSError, ValueError):
        return True
    return dataclasses.replace(now, description=plan.description) != plan


def _judge(plan: Plan, out: Path, cand: Setting, carried: Setting, base: Path, env: Dict[str, str],
           runner: Runner) -> Dict[str, Any]:
    """Run one candidate on a copy of the baseline's folder and append its verdict."""
    _copy_of(base, out / cand.name)
    wall = _run(f"candidate {cand.name} ({cand.words()})",
                cv_command(plan, out / cand.name, cand, carried, base), env, out / f"{cand.name}.log", runner)
    return _record_verdict(plan, out, cand, carried, base, wall)


def _record_verdict(plan: Plan, out: Path, cand: Setting, carried: Setting, base: Path, wall: float,
                    **extra: Any) -> Dict[str, Any]:
    """The verdict row of ``cand``'s finished (or stopped) run, appended to ``verdicts.jsonl`` and said."""
    row = {"name": cand.name, "overrides": list(cand.overrides), "flags": list(cand.flags),
           "carried": [*carried.flags, *carried.overrides], "baseline": str(base), "dir": str(out / cand.name),
           **verdict(out / cand.name, base, plan), "wall_s": round(wall, 1), **extra,
           "judged_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _append(out / "verdicts.jsonl", row)
    _say(f"{cand.name}: {describe(row)}")
    return row


def _judge_interleaved(plan: Plan, out: Path, cand: Setting, carried: Setting, base: _Baseline, env: Dict[str, str],
                       runner: Runner) -> Dict[str, Any]:
    """Make the unfinished baseline and run ``cand`` beside it, fold by fold; append the verdict.

    For k = 1..K: the baseline's cv through fold k (it resumes its finished folds), its fold-k
    pretrained models copied into the candidate's folder, the candidate's cv through fold k against
    it with ``--need-folds``. The candidate's ``cv_stopped.json`` ends it (the baseline stays
    unfinished for the next candidate); after fold K both runs are whole and the verdict is
    :func:`verdict`'s, as for :func:`_judge`.
    """
    n = _flag_value(plan.cv, "--folds", 4)
    run = out / cand.name
    wall = 0.0
    for k in range(1, n + 1):
        through = ["--through-fold", str(k)]
        _run(f"baseline (through fold {k} of {n}, beside {cand.name})", base.command(plan) + through, env,
             out / "baseline.log", runner)
        _copy_of(base.dir, run)  # the first time: tokens, folds and fold 1 (a copy, as _judge makes)
        _share_pretraining(base.dir, run, k)
        wall += _run(f"candidate {cand.name} ({cand.words()}; through fold {k} of {n})",
                     cv_command(plan, run, cand, carried, base.dir, through), env, out / f"{cand.name}.log", runner)
        if (run / "cv_stopped.json").exists():
            break
    base.unfinished = not (base.dir / "cv_metrics.json").exists()
    return _record_verdict(plan, out, cand, carried, base.dir, wall, interleaved=True)


def _share_pretraining(src_job: Path, dest_job: Path, k: int) -> None:
    """Copy fold ``k``'s pretrained models of ``src_job`` into ``dest_job`` where it has none.

    The candidate's cv keeps a copied stage only when its stamp equals what it would run itself
    (a candidate that changes the pretraining redoes it), so nothing is trusted that it would not
    have made. Each copy is whole or absent.
    """
    from hlmtune.hlm.cv import fold_folder

    runs_src, runs_dest = fold_folder(src_job, k) / "runs", fold_folder(dest_job, k) / "runs"
    for src in sorted(runs_src.glob("pretrain*")) if runs_src.is_dir() else ():
        dest = runs_dest / src.name
        if not dest.exists() and src.is_dir() and "." not in src.name:  # "pretrain.copying": a copy cut short
            _copy_stage(src, dest)


def _pooled_figure(row: Dict[str, Any]) -> Tuple[Optional[float], Optional[float]]:
    """A verdict row's pooled figure of its rule (this run, baseline); rows written before
    ``rule.figure`` hold macro-F1 only. (None, None) for a stopped run."""
    pair = row.get("pooled_figure") or (row["pooled_macro_f1"], row["baseline_macro_f1"])
    return pair[0], pair[1]


def describe(row: Dict[str, Any]) -> str:
    """One line per verdict: the figures the rule used and the outcome."""
    if row["stopped_after_fold"] is not None:
        return (f"rejected after fold {row['stopped_after_fold']} (--need-folds): fold deltas "
                + " / ".join(f"{d:+.3f}" for d in row["fold_deltas"]))
    this, base = _pooled_figure(row)
    return (f"{'ADOPTED' if row['adopted'] else 'not adopted'}: pooled {FIGURES[row.get('figure', 'macro_f1')]} "
            f"{this:.3f} vs {base:.3f} ({row['pooled_delta']:+.3f}), {row['folds_at_or_above']} of "
            f"{len(row['fold_deltas'])} folds at or above")


def write_summary(plan: Plan, out: Path, rows: Sequence[Dict[str, Any]], carried: Setting,
                  current: Optional[Path] = None) -> Path:
    """``plan.md``: the baseline, every verdict so far and the settings adopted (written atomically)."""
    from hlmtune.files import atomic_write_text

    base_file = out / "baseline" / "cv_metrics.json"
    if base_file.exists():
        base_line = _pooled_words(json.loads(base_file.read_text())["pooled"], plan) + "."
    elif rows and rows[0].get("baseline_macro_f1") is not None:
        first = rows[0]
        base_line = f"pooled macro-F1 {first['baseline_macro_f1']:.3f} (from the first verdict; its folder is not here)."
        if plan.figure != "macro_f1" and first.get("figure", "macro_f1") == plan.figure:
            base_line = f"pooled {plan.figure_words} {_pooled_figure(first)[1]:.3f}, {base_line}"
    else:
        base_line = "not run yet."
    judged = {r["name"] for r in rows}
    f1 = lambda v: "" if v is None else f"{v[0]:.3f} ({v[0] - v[1]:+.3f})"  # noqa: E731
    lines = [
        f"# Model-selection plan `{plan.source.name}`: {len(rows)} of {len(plan.candidates)} candidates judged",
        "",
        "Every figure is patient-wise cross-validation over the training patients (`hlmtune cv`); DS2 was not read.",
        f"Rule: adopted when the pooled ensemble {plan.figure_words} is at least {plan.min_gain:+.3f} above the "
        f"baseline's and at least {plan.min_folds} folds are at or above it.",
        "",
        f"Baseline (`{plan.baseline.words()}`"
        + (f"; every run also `{' '.join(plan.fixed)}`, the configs as the plan was written" if plan.fixed else "")
        + f"): {base_line}",
        "",
        f"| candidate | setting | pooled {plan.figure_words} (vs its baseline) | folds at or above | S F1 | V F1 "
        "| baseline's pretrained models | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        this = _pooled_figure(r)[0]
        pooled = "" if this is None else f"{this:.3f} ({r['pooled_delta']:+.3f})"
        outcome = ("adopted" if r["adopted"] else "not adopted" if r["stopped_after_fold"] is None
                   else f"stopped after fold {r['stopped_after_fold']}")
        lines.append(f"| {r['name']} | `{' '.join([*r['flags'], *r['overrides']])}` | {pooled} | "
                     f"{r['folds_at_or_above']} of {len(r['fold_deltas'])} | {f1(r['s_f1'])} | {f1(r['v_f1'])} | "
                     f"{_same_words(r)} | {outcome} |")
    waiting = [c.name for c in plan.candidates if c.name not in judged]
    adopted = [r["name"] for r in rows if r["adopted"]]
    lines += ["", f"Adopted so far: {', '.join(f'`{n}`' for n in adopted) if adopted else 'none'}; "
                  f"the settings now: `{carried.words()}`."]
    if current is not None and (current / "cv_metrics.json").exists():
        now = _pooled_words(json.loads((current / "cv_metrics.json").read_text())["pooled"], plan)
        lines.append(f"The current baseline: `{current.name}/` ({now}).")
    lines.append(f"Not yet judged: {', '.join(waiting)}." if waiting else "Every candidate is judged: the plan is done.")
    atomic_write_text(out / "plan.md", "\n".join(lines) + "\n")
    return out / "plan.md"


def _pooled_words(pooled: Dict[str, Any], plan: Plan) -> str:
    """A cv result's pooled figures as plan.md names them: the rule's figure first, then macro-F1."""
    macro = f"pooled macro-F1 {pooled['macro_f1']:.3f}"
    if plan.figure == "macro_f1":
        return macro
    figure = figure_of(pooled, plan.figure)
    return macro if figure is None else f"pooled {plan.figure_words} {figure:.3f}, {macro}"


def _same_words(row: Dict[str, Any]) -> str:
    if row.get("restored_from"):
        return "restored row"
    same = row.get("same_pretraining")
    return "unknown" if same is None else f"{same} of {len(row['fold_deltas'])} folds"


def register(subparsers: Any) -> None:
    """Add ``hlmtune select``."""
    p = subparsers.add_parser(
        "select",
        help="run a model-selection plan: hlmtune cv candidates in order, each judged by the plan's rule",
        description=textwrap.fill(
            "Run a plan written before its runs: the baseline's `hlmtune cv`, then each candidate on a copy of the "
            "current baseline's folder (same folds and pretrained models) with --baseline and --need-folds, judged "
            "by the plan's rule; an adopted candidate becomes the baseline of the ones after it. Verdicts are "
            "appended to OUT/verdicts.jsonl and summed up in OUT/plan.md; a rerun resumes. DS2 is never read."),
        epilog=(
            "examples:\n"
            "  hlmtune select hlm_smoke --out /tmp/select       # synthetic records, 2 tiny folds: a few minutes\n"
            "  hlmtune select hlm_61_patients --out outputs/select --dry-run   # the next command, nothing run\n"
            "  hlmtune select hlm_61_patients --show > my_plan.yaml   # a plan of your own: edit it before its runs\n"
            "  hlmtune select hlm_61_patients --out outputs/select --max-candidates 1\n"
            "                                  # judge one more candidate (about 1-2 h on 2 CPU cores), then stop\n"
            "  hlmtune select hlm_61_patients --out /scratch/select --record docs/selection/hlm_61_patients\n"
            "                                  # figures and verdicts also in a folder you commit\n"
            f"packaged plans: {', '.join(sorted(p.stem for p in PLANS_DIR.glob('*.yaml')))}"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan", help="a plan file, or the name of a packaged plan")
    p.add_argument("--out", default=None, help="the job folder (resumed when it exists); required unless --show")
    p.add_argument("--show", action="store_true",
                   help="print the plan file (to start your own: hlmtune select hlm_61_patients --show > my_plan.yaml)")
    p.add_argument("--max-candidates", type=int, default=None, metavar="N",
                   help="judge at most N more candidates in this call (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the next hlmtune cv command and stop")
    p.add_argument("--interleave", action="store_true",
                   help="a baseline that has to be made here (none yet, or another host's) is made fold by fold "
                        "beside the next candidate (hlmtune cv --through-fold): a candidate rejected after two folds "
                        "then costs two folds of each instead of the whole baseline first")
    p.add_argument("--record", default=None, metavar="REC",
                   help="a folder of the plan's small files (verdicts, plan.md, each run's figures and report; "
                        "no model), read first to seed --out and written after every run: commit it to carry "
                        "a plan across machines (there, the current baseline's fold 1 is pretrained once: its "
                        "recorded figures stand when the checkpoint has the recorded bytes, or those of a run kept "
                        "in REC/hosts/<digest>/ from a host like this one, else it is re-made)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from hlmtune.hlm.pipeline import exit_status

    def job() -> None:
        if args.max_candidates is not None and args.max_candidates < 1:
            raise ValueError(f"--max-candidates {args.max_candidates}: at least 1")
        path = resolve_plan(args.plan)
        if args.show:
            sys.stdout.write(path.read_text())
            return
        if args.out is None:
            raise ValueError("--out DIR: the job folder (or --show to print the plan)")
        rows = run_plan(load_plan(path), Path(args.out), max_candidates=args.max_candidates, dry_run=args.dry_run,
                        record=None if args.record is None else Path(args.record), interleave=args.interleave)
        for row in rows:
            print(f"{row['name']}: {describe(row)}")
        if not args.dry_run:
            print(f"summary: {Path(args.out) / 'plan.md'}")

    return exit_status("select", job)[0]
