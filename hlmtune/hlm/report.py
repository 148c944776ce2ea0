"""Report rendering of HLM evaluations: tables, the published baselines, the confusion plot.

What ``hlmtune eval``, ``hlmtune demo`` and ``hlmtune cv`` print and write as Markdown and PNG;
the figures themselves come from :mod:`hlmtune.hlm.metrics`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hlmtune.hlm.detection import NO_BEAT
from hlmtune.hlm.metrics import PREMATURE_RATIO

# Published inter-patient results on MIT-BIH DS2 (train DS1), as the papers state them.
# Se / +P in percent; F1 as a fraction. Only figures the papers give.
BASELINES: List[Dict[str, Any]] = [
    {"method": "de Chazal et al. 2004 (linear discriminants)", "S_se": 75.9, "S_ppv": 38.5, "V_se": 77.7, "V_ppv": 81.9},
    {"method": "Zhang et al. 2014 (feature selection + SVM)", "S_se": 79.1, "S_ppv": 36.0, "V_se": 85.5, "V_ppv": 92.7},
    {"method": "Niu et al. 2020 (symbolized beats + CNN)", "S_f1": 0.766, "V_f1": 0.897},
]



def trained_on(train: Sequence[str], test: Sequence[str], *, split_file: Optional[str]) -> str:
    """Where a run's training records come from, for the report header (``DS1 22 + svdb 39``).

    Records of the test records' database (or bare ids) count as the split's DS1; the others by
    their database.
    """
    from hlmtune.ecg_tokenizer.splits import database_of

    home = {database_of(t) for t in test} or {""}
    own = "DS1" if split_file is None else "split file DS1"
    counts: Dict[str, int] = {}
    for r in train:
        db = database_of(r)
        key = own if db in home or not db else db
        counts[key] = counts.get(key, 0) + 1
    if list(counts) == [own]:
        return own
    return " + ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: kv[0] != own))


def held_out_described(split: str, test: Sequence[str], *, split_file: Optional[str]) -> str:
    """What a run was tested on, for the report header (``DS2 (unseen patients)``).

    Without a split file the split is MIT-BIH's own. A split file (``hlmtune cv`` writes one per
    fold) makes its DS2 the records it holds out, which are training patients of the project,
    not MIT-BIH DS2, unless they are exactly MIT-BIH DS2: the header says which.
    """
    from hlmtune.ecg_tokenizer.splits import MITDB_DS2, TEST, database_of

    mitdb = [r.split("/")[-1] for r in test if database_of(r) in ("", "mitdb")]
    own = len(mitdb) == len(test) and sorted(mitdb) == sorted(MITDB_DS2)
    if split_file is None or (split == TEST and own):
        return f"{split} (unseen patients)"
    return f"split file {split} ({len(test)} records held out of training, not MIT-BIH DS2)"


def ordered_results(metrics: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """``metrics["results"]`` in the evaluation's row order (``metrics.json`` sorts its keys),
    the headline row (``metrics["result"]``: calibrated, else the ensemble, else the run) first."""
    res = metrics["results"]
    order = [n for n in metrics.get("row_order", []) if n in res] or list(res)
    head = metrics.get("result")
    if head in res:
        order = [head, *(n for n in order if n != head)]
    return {n: res[n] for n in order}


def headline(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """The row an evaluation reports as its result (see :func:`ordered_results`)."""
    return next(iter(ordered_results(metrics).values()))


def _fmt(v: Optional[float], pct: bool = True) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}" if pct else f"{v:.3f}"


def baseline_table(results: Dict[str, Dict[str, Any]]) -> str:
    """Markdown table: our S and V figures per evaluated model beside the published baselines."""
    lines = [
        "| method | S Se % | S +P % | S F1 | V Se % | V +P % | V F1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s, v = r["per_class"].get("S", {}), r["per_class"].get("V", {})
        lines.append(
            f"| **{name}** | {_fmt(s.get('se'))} | {_fmt(s.get('ppv'))} | {_fmt(s.get('f1'), False)} | "
            f"{_fmt(v.get('se'))} | {_fmt(v.get('ppv'))} | {_fmt(v.get('f1'), False)} |"
        )
    for b in BASELINES:
        cell = lambda k, pct: (f"{b[k]:.1f}" if pct else f"{b[k]:.3f}") if k in b else "-"  # noqa: E731
        lines.append(
            f"| {b['method']} | {cell('S_se', 1)} | {cell('S_ppv', 1)} | {cell('S_f1', 0)} | "
            f"{cell('V_se', 1)} | {cell('V_ppv', 1)} | {cell('V_f1', 0)} |"
        )
    return "\n".join(lines)


def class_table(r: Dict[str, Any], classes: Optional[Sequence[str]] = None) -> str:
    """Markdown per-class table of one result, rows in ``classes`` order (``metrics.json``
    stores ``per_class`` with sorted keys: pass ``metrics["classes"]`` to keep N S V F)."""
    lines = ["| class | support | Se % | +P % | F1 |", "|---|---|---|---|---|"]
    for c in (classes or list(r["per_class"])):
        v = r["per_class"][c]
        lines.append(f"| {c} | {v['support']} | {_fmt(v['se'])} | {_fmt(v['ppv'])} | {_fmt(v['f1'], False)} |")
    lines.append(f"| macro | {r['n']} | | | {_fmt(r['macro_f1'], False)} |")
    return "\n".join(lines)


# How to read a cell of record_table(), for the reports that print one (eval, demo, cv).
RECORD_TABLE_LEGEND = ("Per class: beats of the class classified as it / beats of the class (+ beats of other "
                       "classes classified as it).")


def _found_cell(x: Dict[str, Any]) -> str:
    """``found / beats (+ false)`` of one class (see :data:`RECORD_TABLE_LEGEND`)."""
    return f"{x['tp']} / {x['support']}" + (f" (+{x['fp']})" if x["fp"] else "")


def record_table(r: Dict[str, Any], classes: Sequence[str]) -> str:
    """Markdown table of a result's ``per_record`` figures: per class, found / beats (+ false).

    A cell ``12 / 1382 (+3)`` reads: of the record's 1,382 beats of the class, 12 were
    classified as it, and 3 beats of other classes were classified as it.
    """
    lines = ["| record | beats | " + " | ".join(classes) + " | accuracy % |",
             "|---|---|" + "---|" * len(classes) + "---|"]
    for rec, v in r["per_record"].items():
        cells = [_found_cell(v["per_class"][c]) for c in classes]
        lines.append(f"| {rec} | {v['n']} | " + " | ".join(cells) + f" | {_fmt(v['accuracy'])} |")
    return "\n".join(lines)


# How to read timing_table(), for the reports that print one (eval, demo, cv).
TIMING_TABLE_LEGEND = ("The target beat's RR token as the model read it (its interval relative to the patient's "
                       "running reference RR: the run's `rr_reference` over its last `normalized_rr` intervals, as "
                       "its config names them). An S beat is a normal beat that comes early: S beats that are not "
                       "premature by this token must be told by their waveform alone. " + RECORD_TABLE_LEGEND)


def timing_table(r: Dict[str, Any], classes: Sequence[str], threshold: float = PREMATURE_RATIO) -> str:
    """Markdown table of a result's ``by_timing`` figures (cells as :func:`record_table`'s)."""
    names = {"premature": f"premature (RR < {threshold:g} x running reference)",
             "on_time": f"on time (>= {threshold:g})", "unknown": "interval unknown (record start)"}
    lines = ["| target beat's RR token | beats | " + " | ".join(classes) + " |",
             "|---|---|" + "---|" * len(classes)]
    for bucket, v in r["by_timing"].items():
        cells = [_found_cell(v["per_class"][c]) for c in classes]
        lines.append(f"| {names[bucket]} | {v['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_confusion(m: List[List[int]], classes: Sequence[str], path: Path, title: str) -> None:
    """Row-normalised confusion matrix with counts, as PNG (atomic write)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hlmtune.files import atomic_write_bytes

    n = len(classes)
    rows = [[m[i][j] / max(1, sum(m[i])) for j in range(n)] for i in range(n)]
    fig, ax = plt.subplots(figsize=(1.2 * n + 2, 1.2 * n + 1.5))
    ax.imshow(rows, vmin=0, vmax=1, cmap="Blues")
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{m[i][j]}\n{100 * rows[i][j]:.0f}%", ha="center", va="center",
                    color="white" if rows[i][j] > 0.5 else "black", fontsize=8)
    ax.set_xticks(range(n), classes)
    ax.set_yticks(range(n), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true (annotation)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def detector_summary(beats: Dict[str, Any]) -> str:
    """What the QRS detector of ``--beats detector`` found (``metrics.json``'s ``beats``), and how it is scored."""
    found = beats["matched"] + beats["missed"]
    return (f"Beats: the {beats['detector']} QRS detector found {beats['matched']} of the {found} reference beats of "
            f"the scored classes within {beats['window_s'] * 1000:.0f} ms (Se {_fmt(beats['sensitivity'])} %) and "
            f"made {beats['extra']} detections with no reference beat (+P {_fmt(beats['positive_predictivity'])} %). "
            f"A missed beat counts against its class's Se (the \"{NO_BEAT}\" column of the confusion matrix), an "
            f"extra detection against the +P of the class it was given (the \"{NO_BEAT}\" row); a reference beat "
            "found only at a record edge, where no window fits, is left out.")


def eval_report_markdown(metrics: Dict[str, Any], *, title: str, model_runs: Sequence[Path]) -> str:
    """``report.md`` of ``hlmtune eval`` from its ``metrics.json`` content.

    Args:
        metrics (Dict[str, Any]): the evaluation's metrics (``notice``, ``results`` in row order,
            ``result``, ``classes``, ``task``, ``split_kind``).
        title (str): what was evaluated (the model builder).
        model_runs (Sequence[Path]): the run folders whose exports were scored (the ensemble's).

    Returns:
        str: Markdown.
    """
    results, classes = metrics["results"], metrics["classes"]
    first = results[metrics["result"]]
    md = [f"**{metrics['notice']}**", "", f"# HLM evaluation: {title}", ""]
    dropped = metrics.get("test_records_dropped")
    if dropped:
        md += [f"Test records: {dropped} beat annotations dropped when tokenizing them (at record edges, outside "
               "the signal, or symbols outside the WFDB table); see the test shards' manifest.", ""]
    if (metrics.get("beats") or {}).get("positions") == "detector":
        md += [detector_summary(metrics["beats"]), ""]
    for name in metrics["row_order"]:
        r = results[name]
        md += [f"## {name}", "", class_table(r), "",
               f"Next token outside the class tokens (unconstrained argmax): {r['off_vocabulary_argmax']} of {r['n']}."
               if r["off_vocabulary_argmax"] is not None else
               f"The row below with a class bias added to its log-probabilities "
               f"({', '.join(f'{c} {b:+.2f}' for c, b in r['class_bias'].items())}), fitted on out-of-fold "
               f"predictions for DS1 patients (`{r['calibration']}`), never on the test split."
               if "class_bias" in r else
               f"Mean over the {len(model_runs)} runs below of each one's class-token log-probabilities; "
               f"runs: {', '.join(f'`{p}`' for p in model_runs)}.", ""]
    if metrics["task"] == "beat":
        md += ["## Beside the published inter-patient baselines (MIT-BIH DS1 -> DS2)", "",
               baseline_table({n: results[n] for n in metrics["row_order"]}), "",
               "Baseline figures as the papers state them; ours from `metrics.json`."
               + (" Not comparable: random beat split." if metrics["split_kind"] == "random_beats" else ""), ""]
    md += ["![confusion matrix](confusion.png)", "",
           f"## Per record: {metrics['result']}", "",
           RECORD_TABLE_LEGEND, "", record_table(first, classes), ""]
    if "by_timing" in first:
        md += [f"## By the target beat's timing: {metrics['result']}", "", TIMING_TABLE_LEGEND, "",
               timing_table(first, classes), ""]
    return "\n".join(md)


def job_report_markdown(metrics: Dict[str, Any], *, described: str, model: str, nproc: int, seeds: int,
                        pretrain_seeds: Sequence[int], calibration: Optional[Path], mitdb: bool,
                        training_rows: Sequence[str], plots: Sequence[str], timings: Dict[str, Optional[float]],
                        runs: Sequence[Path]) -> str:
    """``report.md`` of ``hlmtune demo`` (the main job) from its evaluation and training records.

    Args:
        metrics (Dict[str, Any]): the evaluation's ``metrics.json`` content.
        described (str): the data, as the report names it.
        model (str): the HLM size.
        nproc (int): CPU ranks.
        seeds (int): fine-tunes (an ensemble when more than one).
        pretrain_seeds (Sequence[int]): the pretrainings' seeds.
        calibration (Optional[Path]): the class-bias file applied, if any.
        mitdb (bool): the data is MIT-BIH (its DS2 is the published baselines' test set).
        training_rows (Sequence[str]): one table row per training run.
        plots (Sequence[str]): the training plots' file names.
        timings (Dict[str, Optional[float]]): wall seconds per stage.
        runs (Sequence[Path]): every run folder of the job.

    Returns:
        str: Markdown.
    """
    result = headline(metrics)
    p = len(pretrain_seeds)
    ensemble = (f" Classifier: an ensemble of {seeds} LoRA fine-tunes (seeds 0-{seeds - 1}) of "
                + ("the same pretrained model" if p == 1 else
                   f"{p} pretrained models (seeds {pretrain_seeds[0]}-{pretrain_seeds[-1]}; fine-tune k from "
                   f"pretraining k mod {p})")
                + ", predicting the class of highest mean log-probability; each run's own figures are in "
                "`metrics.json`." if seeds > 1 else "")
    decision = (f" Decision: a per-class bias on the class log-probabilities fitted on DS1 out-of-fold predictions "
                f"(`{calibration}`, `hlmtune cv`); the uncalibrated figures are in `metrics.json`." if calibration else "")
    comparable = (" Ours here are on SYNTHETIC records: not comparable." if described.startswith("SYNTHETIC")
                  else "" if mitdb else f" Ours here are on {described}, not MIT-BIH DS2: not comparable.")
    lines = [
        f"**{metrics['notice']}**", "",
        "# Heart Language Model: main job report", "",
        f"Data: {described}. Model: `{model}` (Llama3 architecture). Ranks: {nproc} (CPU)." + ensemble + decision, "",
        "## Results on the test split", "",
        class_table(result), "",
        "## Beside the published inter-patient baselines (MIT-BIH DS1 -> DS2)", "",
        baseline_table(ordered_results(metrics)), "",
        "Baselines as the papers state them." + comparable, "",
        "![confusion matrix](confusion.png)", "",
        f"## Per record: {metrics['result']}", "",
        "Inter-patient figures hinge on a few patients. " + RECORD_TABLE_LEGEND, "",
        record_table(result, metrics["classes"]), "",
        *([f"## By the target beat's timing: {metrics['result']}", "", TIMING_TABLE_LEGEND, "",
           timing_table(result, metrics["classes"]), ""] if "by_timing" in result else []),
        "## Training", "",
        "| stage | steps | first loss | last loss | median s/it | peak RSS GiB | wall s |",
        "|---|---|---|---|---|---|---|",
        *training_rows, "",
        "Wall s of a run kept from an earlier call is the time recorded when it ran.", "",
        *[f"![{p}]({p})" for p in plots], "",
        "## Wall time (s)", "",
        " | ".join(f"{k} {'unknown' if v is None else f'{v:.0f}'}" for k, v in timings.items() if k != "kept_runs"), "",
        f"Runs: {', '.join(f'`{r}`' for r in runs)}; per-step metrics in `<run>/metrics/steps.jsonl`; "
        "eval in `metrics.json`.", "",
    ]
    return "\n".join(lines)


def cv_report_markdown(doc: Dict[str, Any], *, members: Sequence[Dict[str, Any]], baseline: Sequence[str]) -> str:
    """``report.md`` of ``hlmtune cv`` from its ``cv_metrics.json`` content.

    Args:
        doc (Dict[str, Any]): the cross-validation's figures (folds, pooled, nested, fitted, bias).
        members (Sequence[Dict[str, Any]]): each seed pooled over the folds (empty for one seed).
        baseline (Sequence[str]): the lines comparing this run with a baseline run (may be empty).

    Returns:
        str: Markdown.
    """
    import numpy as np

    classes, pooled, nested, fitted = doc["classes"], doc["pooled"], doc["pooled_nested_calibration"], \
        doc["pooled_fitted_in_sample"]
    folds, seeds, pretrainings, pretrain_seed = doc["n_folds"], doc["seeds"], doc["pretrainings"], doc["pretrain_seed"]
    overrides, bias = doc["finetune_overrides"], [doc["class_bias"][c] for c in classes]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    f1_cells = lambda r: " | ".join(fmt(r["per_class"][c]["f1"]) for c in classes) + f" | {fmt(r['macro_f1'])} |"  # noqa: E731
    per_db = pooled.get("per_database", {})
    lines = [
        f"**Patient-wise {folds}-fold cross-validation over the training patients ({doc['data']})"
        + (f", partition {doc['partition']} of them into folds" if doc.get("partition", 1) != 1 else "")
        + ": every beat below "
        "is predicted by a model that never saw its patient. DS2 was not read. Not comparable to DS1 -> DS2 figures "
        "or the published DS2 baselines.**",
        "",
        f"# HLM cross-validation: `{doc['model']}`, {doc['finetune_examples']} fine-tuning examples per fold"
        + (f", {seeds} seeds per fold (ensemble)" if seeds > 1 else "")
        + (f" from {pretrainings} pretrainings" if pretrainings > 1 else "")
        + (f", pretraining seed {pretrain_seed}" + (f"-{pretrain_seed + pretrainings - 1}" if pretrainings > 1 else "")
           if pretrain_seed else "")
        + (f", overrides `{' '.join(overrides)}`" if overrides else ""),
        "",
        "## Folds",
        "",
        "| fold | held-out records | beats | " + " | ".join(f"{c} F1" for c in classes) + " | macro-F1 |",
        "|---|---|---|" + "---|" * len(classes) + "---|",
        *[f"| {r['fold']} | {' '.join(r['held_out'])} | {r['n']} | " + f1_cells(r) for r in doc["folds"]],
        "",
        "## Pooled out-of-fold predictions",
        "",
        class_table(pooled, classes),
        "",
        *[line for name, r in per_db.items() if len(per_db) > 1
          for line in (f"### Patients of {name} only", "", class_table(r, classes), "")],
        *(["## Ensemble members, pooled over the folds (one fine-tuning seed each)", "",
           "| member | " + " | ".join(f"{c} F1" for c in classes) + " | macro-F1 |",
           "|---|" + "---|" * len(classes) + "---|",
           *[f"| {m['name']} | " + f1_cells(m) for m in members],
           "",
           f"Members' mean {fmt(float(np.mean([m['macro_f1'] for m in members])))}, the ensemble "
           f"{fmt(pooled['macro_f1'])}: a setting is judged against the spread of the members, not one of them.",
           ""] if members else []),
        *baseline,
        "## With a class bias fitted on the other folds (nested: what calibration buys, honestly)",
        "",
        class_table(nested, classes),
        "",
        "Bias fitted on all folds (`calibration.json`, for `hlmtune eval --calibration`): "
        + ", ".join(f"{c} {b:+.2f}" for c, b in zip(classes, bias))
        + f" (in-sample pooled macro-F1 {fmt(fitted['macro_f1'])}, an optimistic figure: use the nested one).",
        "",
        f"Confusion (rows true, columns predicted {' / '.join(classes)}), pooled, uncalibrated: "
        + "; ".join(f"{c} {' / '.join(map(str, row))}" for c, row in zip(classes, pooled["confusion"])),
        "",
        "## Per record (pooled, uncalibrated)",
        "",
        *([RECORD_TABLE_LEGEND, "", record_table(pooled, classes)] if "per_record" in pooled else
          ["Not available: a fold's `predictions.npz` names no records."]),
        "",
        *(["## By the target beat's timing (pooled, uncalibrated)", "", TIMING_TABLE_LEGEND, "",
           timing_table(pooled, classes), ""] if "by_timing" in pooled else []),
    ]
    return "\n".join(lines)
