"""The beat dataset's build and its examples on the training patients, side by side in one run.

Every fold and seed of ``hlmtune cv``, ``hlmtune demo`` and ``benchmarks/ecg_quality.py`` builds one
``ECGBeatClassificationDataset`` (per-record RR tokens against the running reference, templates,
feature tokens, the synthetic and weighted draw of the epoch), and the data loader then assembles
each example's prompt (``example``: crop, augmentation, the drawn intervals). This times both for
the ``dataset`` section of ``--config`` (default ``configs/ecg_lora.yaml``: the shipped settings)
and for variants that each add what a model-selection plan tried on top of it:

* ``p_wave_beats: 8`` (plan ``hlm_p_wave``: the P-wave likeness of the 8 earlier beats, computed
  from every beat window of every record at build time);
* ``early_n_weight: 8`` (plan ``hlm_early_n``: the draw weights of the early N beats);
* ``second_lead: 32`` (plan ``hlm_second_lead``: 32 samples of the record's second lead after the
  first lead's, with their own templates and amplitude map).

Reported: build seconds (best and median of ``--repeats``, variants interleaved), examples per second
over the first ``--examples`` examples of the draw (best of the repeats), each as a ratio to the
config's own row. Tokens: the records tokenized once into a temporary folder as ``hlmtune demo``
tokenizes them (``TokenizerParams(rr_bins=64)``, with the second lead's windows, which only the
``second_lead`` row reads): MIT-BIH DS1 of ``$HLM_DATA/mitdb`` and every record
of ``$HLM_DATA/svdb`` (the 61 training patients), or the folders given with ``--records``. One
process, one thread (the data loader's workers each do the same work on their share).

Usage: ``HLM_DATA=../shared/data python benchmarks/beat_dataset_build.py [--repeats 3] [--examples 2000]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Dataset keys that choose records, not what an example shows (the benchmark reads every record).
SOURCE_KEYS = ("_component_", "split", "split_file", "extra_records", "shards_dir", "records", "random_test_fraction")
VARIANTS = {"p_wave_beats 8": {"p_wave_beats": 8}, "early_n_weight 8": {"early_n_weight": 8.0},
            "second_lead 32": {"second_lead": 32}}


def dataset_options(config: Path) -> Dict[str, Any]:
    """The config's ``dataset`` keys that shape examples (record choice left out)."""
    import yaml

    ds = yaml.safe_load(Path(config).read_text()).get("dataset") or {}
    return {k: v for k, v in ds.items() if k not in SOURCE_KEYS}


def tokenize(folders: Sequence[Tuple[Path, str, Optional[List[str]]]], out: Path) -> Dict[str, Any]:
    """Tokenize ``folders`` (path, database name, records or None for all) into ``out`` as ``hlmtune
    demo`` does, the second lead's windows included; the manifest."""
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, RecordSource, tokenize_sources
    from hlmtune.ecg_tokenizer.shards import read_manifest
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams
    from hlmtune.hlm.pipeline import RR_BINS

    sources = [RecordSource(d, db, names) for d, db, names in folders]
    summary = tokenize_sources(sources, out, params=TokenizerParams(rr_bins=RR_BINS),
                               options=RecordOptions(second_lead=True),
                               workers=1, progress=False)
    if not summary.ok:
        raise SystemExit("tokenize failed for some records:\n" + summary.format())
    return read_manifest(str(out))


def build(manifest: Dict[str, Any], options: Dict[str, Any]):
    """One dataset over every record of ``manifest`` with ``options`` (a config's dataset keys)."""
    from hlmtune.data_builders.beat_prompt import parse_options
    from hlmtune.data_builders.ecg import ECGBeatClassificationDataset

    _, draw, prompt = parse_options("ecg_beat_classification_dataset", options)
    return ECGBeatClassificationDataset(manifest, [r["record"] for r in manifest["records"]], prompt=prompt, draw=draw)


def measure(manifest: Dict[str, Any], rows: Dict[str, Dict[str, Any]], repeats: int, examples: int
            ) -> Dict[str, Dict[str, List[float]]]:
    """Per row: build seconds and examples/s of each repeat (rows interleaved within a repeat)."""
    out: Dict[str, Dict[str, List[float]]] = {k: {"build_s": [], "examples_per_s": []} for k in rows}
    for _ in range(repeats):
        for name, options in rows.items():
            t0 = time.perf_counter()
            ds = build(manifest, options)
            t1 = time.perf_counter()
            n = min(examples, len(ds))
            for k in range(n):
                ds[k]
            t2 = time.perf_counter()
            out[name]["build_s"].append(t1 - t0)
            out[name]["examples_per_s"].append(n / (t2 - t1))
    return out


def _folders(args: argparse.Namespace) -> List[Tuple[Path, str, Optional[List[str]]]]:
    from training_patients import training_folders

    if args.records:
        return [(Path(d), Path(d).resolve().name, None) for d in args.records]
    return list(training_folders())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", nargs="+", default=None, metavar="DIR",
                    help="WFDB folders, every record of each, named by the folder (default: DS1 of "
                         "$HLM_DATA/mitdb + $HLM_DATA/svdb)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions of each measurement (default: 3)")
    ap.add_argument("--examples", type=int, default=2000, help="examples assembled per build (default: 2000)")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "ecg_lora.yaml",
                    help="the config whose dataset section is the first row (default: configs/ecg_lora.yaml)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.examples < 1:
        ap.error(f"--repeats {args.repeats} --examples {args.examples}: each at least 1")
    folders = _folders(args)
    base = dataset_options(args.config)
    rows = {args.config.name: base, **{k: {**base, **v} for k, v in VARIANTS.items()}}
    with tempfile.TemporaryDirectory(prefix="hlm-bench-tokens-") as tmp:
        manifest = tokenize(folders, Path(tmp))
        measure(manifest, {args.config.name: base}, 1, 10)  # imports and first-call costs out of the timed runs
        load = os.getloadavg()[0]
        times = measure(manifest, rows, args.repeats, args.examples)
        beats = sum(int(r.get("n_beats", 0)) for r in manifest["records"])
    first = args.config.name
    best_build = {k: min(v["build_s"]) for k, v in times.items()}
    best_rate = {k: max(v["examples_per_s"]) for k, v in times.items()}
    print(f"{len(manifest['records'])} records, {beats:,} beats: " + ", ".join(str(d) for d, _, _ in folders)
          + f"; {args.repeats} repeats, {args.examples} examples each; load average before {load:.2f}, "
          f"cpus={os.cpu_count()}; one process")
    print(f"{'dataset options':22s} {'build s':>8s} {'median s':>9s} {'x ' + first:>18s} {'examples/s':>11s} "
          f"{'x ' + first:>18s}")
    for name, v in times.items():
        print(f"{name:22s} {best_build[name]:8.3f} {statistics.median(v['build_s']):9.3f} "
              f"{best_build[name] / best_build[first]:18.2f} {best_rate[name]:11,.0f} "
              f"{best_rate[name] / best_rate[first]:18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
