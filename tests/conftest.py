"""Shared pytest fixtures: data (real or generated stand-ins), the tiny model, the CLI path.

Real data (MIT-BIH, text samples) is found through the ``HLM_DATA`` environment variable
(``make test`` sets it when ``../shared/data`` exists), never through a hard-coded path.

Without ``HLM_DATA`` (a fresh clone, a laptop), the data fixtures return generated
stand-ins so that the recipe, builder and tokenizer tests still run:

- ``text_data_dir``: JSONL files in the layouts of the real samples (alpaca, grammar,
  samsum, slimorca, HH-RLHF messages, stack-exchange pairs), generated from templates;
- ``mitdb_dir``: synthetic WFDB records (``hlmtune.ecg_tokenizer.synth``: format 212, two
  leads, ``.atr`` beat and rhythm annotations) under MIT-BIH record names.

Tests that need the real records or files themselves (published counts, checksums, golden
files, properties of a named real record) ask for ``real_mitdb_dir`` / ``real_text_data_dir``
/ ``hlm_data``, which skip with a clear reason when ``HLM_DATA`` is not set.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Optional

import pytest

# The console script next to the interpreter running the tests (the venv's).
HLMTUNE = str(Path(sys.executable).with_name("hlmtune"))


def pytest_configure(config: pytest.Config) -> None:
    """The CPU fast paths' probes decided once for the whole session, outside the user's ~/.cache.

    Recipes keep a probe's decisions per host (``fastpath.probe_cache_path``); the suite's runs,
    subprocesses included, share a fresh cache folder (nothing is written to the user's), and
    take MKL's GEMMs and attention in query blocks without timing them, so every run of a
    session takes the same paths. A value set outside stands.
    """
    import tempfile

    if not os.environ.get("HLM_CACHE_DIR"):
        os.environ["HLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="hlmtune-test-cache-")
    # oneDNN's GEMMs or MKL's is probed per run at each model's layer shapes; the suite's runs
    # multiply with MKL throughout (torch's own path) so that runs compared with each other
    # agree bit for bit, whatever a borderline timing says. Tests of the oneDNN path force it
    # (HLM_ONEDNN_LINEAR=1); the probe itself is tested in tests/test_training_fastpath.py.
    os.environ.setdefault("HLM_ONEDNN_LINEAR", "0")
    # Attention in query blocks or not is probed per run at each model's shape; the suite's runs
    # take the blocks throughout (as before the probe) so that runs compared with each other
    # agree bit for bit. The probe itself is tested in tests/test_training_fastpath.py.
    os.environ.setdefault("HLM_BLOCKED_ATTENTION", "1")
    # `hlmtune run` without torchrun options splits a CPU run over one rank per core; the
    # suite's runs stay one process each (as they were written: world size 1, one exact loss
    # curve) unless a test asks for ranks. The choice itself: tests/test_launch.py.
    os.environ.setdefault("HLMTUNE_CPU_RANKS", "0")


def _data_root() -> Optional[Path]:
    root = os.environ.get("HLM_DATA")
    return Path(root) if root else None


def _real_folder(root: Path, sub: str, marker: str, what: str) -> Path:
    """``root/sub``, failing (not skipping) when HLM_DATA is set but the folder is wrong."""
    path = root / sub
    if not (path / marker).exists():
        pytest.fail(f"{path} does not hold {what} ({marker} missing)")
    return path


_MITDB = ("mitdb", "100.hea", "MIT-BIH records")
_TEXT = ("text", "alpaca_cleaned.jsonl", "the text samples")


@pytest.fixture(scope="session")
def hlm_data() -> Path:
    """Root of the real data folder (``$HLM_DATA``); skips without it."""
    root = _data_root()
    if root is None:
        pytest.skip("HLM_DATA is not set: this test needs the real data (make test sets it)")
    if not root.is_dir():
        pytest.fail(f"HLM_DATA={root} is not a directory")
    return root


@pytest.fixture(scope="session")
def real_mitdb_dir(hlm_data: Path) -> Path:
    """The complete, real MIT-BIH Arrhythmia Database (``$HLM_DATA/mitdb``)."""
    return _real_folder(hlm_data, *_MITDB)


@pytest.fixture(scope="session")
def real_text_data_dir(hlm_data: Path) -> Path:
    """The real samples of the text datasets (``$HLM_DATA/text``)."""
    return _real_folder(hlm_data, *_TEXT)


# Record names of the stand-in database: the MIT-BIH records the tests name. Records with an
# atrial fibrillation episode are the ones that have one in MIT-BIH (201, 203, 222).
STANDIN_RECORDS = ("100", "101", "102", "103", "105", "106", "119", "201", "203", "207", "208", "212", "222", "232")
_STANDIN_AF = ("201", "203", "222")
STANDIN_SECONDS = 180.0  # tests read up to 150 s of a record


@pytest.fixture(scope="session")
def mitdb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MIT-BIH records: the real database with ``HLM_DATA``, else a synthetic stand-in.

    The stand-in holds :data:`STANDIN_RECORDS` (180 s each, 360 Hz, leads MLII and V1,
    beats ``N``/``V``/``A`` and ``(AFIB`` rhythm episodes in 201, 203, 222) and a
    ``RECORDS`` list, written by the pack's own synthesizer.
    """
    root = _data_root()
    if root is not None:
        return _real_folder(root, *_MITDB)
    from hlmtune.ecg_tokenizer.synth import synthesize_record

    out = tmp_path_factory.mktemp("mitdb-standin")
    for i, name in enumerate(STANDIN_RECORDS):
        synthesize_record(name, out, duration_s=STANDIN_SECONDS, seed=100 + i,
                          af_fraction=0.3 if name in _STANDIN_AF else 0.0)
    (out / "RECORDS").write_text("".join(f"{n}\n" for n in STANDIN_RECORDS))
    return out


@pytest.fixture(scope="session")
def text_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text samples: the real ones with ``HLM_DATA``, else generated files in their layouts."""
    root = _data_root()
    if root is not None:
        return _real_folder(root, *_TEXT)
    out = tmp_path_factory.mktemp("text-standin")
    write_text_standins(out)
    return out


def write_text_standins(out: Path, seed: int = 0) -> None:
    """Write generated stand-ins for the six text samples, in their field layouts.

    Sizes follow the real samples where tests depend on them (slimorca 13 rows, stack-exchange
    25 rows); the rest are large enough for 20+ optimizer steps at batch 4 on 2 ranks and for
    the configs' 500-row subsets. HH-RLHF rows are two-turn conversations, like the real ones.
    Rows are templated arithmetic, spelling and dialogue facts: learnable by a tiny model in a
    few steps, like real instructions are.

    Args:
        out (Path): folder to write into.
        seed (int): RNG seed (same seed, same bytes).
    """
    rng = random.Random(seed)
    words = ["apple", "river", "window", "garden", "silver", "number", "yellow", "market", "pencil", "summer"]
    names = ["Anna", "Ben", "Carl", "Dora", "Emil", "Fay"]

    def write(name: str, rows) -> None:
        with open(out / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    def arithmetic() -> tuple:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."

    def spelling() -> tuple:
        w = rng.choice(words)
        return f"Spell the word {w} backwards.", f"The word {w} backwards is {w[::-1]}."

    alpaca = []
    for i in range(800):
        q, a = arithmetic() if i % 2 else spelling()
        alpaca.append({"instruction": q, "input": "" if i % 3 else f"Example {i}.", "output": a})
    write("alpaca_cleaned.jsonl", alpaca)

    grammar = []
    for _ in range(600):
        n, w = rng.choice(names), rng.choice(words)
        grammar.append({"input": f"{n} have a {w} and they is happy.", "output": f"{n} has a {w} and is happy."})
    write("grammar_c4_200m.jsonl", grammar)

    samsum = []
    for i in range(600):
        a, b = rng.sample(names, 2)
        w = rng.choice(words)
        samsum.append({"id": str(13800000 + i), "dialogue": f"{a}: Do you have the {w}?\r\n{b}: Yes, I will bring it tomorrow.",
                       "summary": f"{b} will bring the {w} to {a} tomorrow."})
    write("samsum.jsonl", samsum)

    slimorca = []
    for _ in range(13):
        q, a = arithmetic()
        slimorca.append({"conversations": [
            {"from": "system", "value": "You are a helpful assistant."},
            {"from": "human", "value": q},
            {"from": "gpt", "value": a},
        ]})
    write("slimorca_sample.jsonl", slimorca)

    def wrong_sum(question: str) -> str:
        # Same words as the right answer, another number: a tiny model cannot add, so the
        # preference is learned pair by pair over epochs, not from one token in the first step.
        a, b = (int(t) for t in question.removeprefix("What is ").removesuffix("?").split(" plus "))
        return f"{a} plus {b} is {rng.choice([n for n in range(4, 199) if n != a + b])}."

    hh = []
    for _ in range(300):
        (q1, a1), (q2, a2) = spelling(), arithmetic()
        turns = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
        hh.append({"chosen": [*turns, {"role": "assistant", "content": a2}],
                   "rejected": [*turns, {"role": "assistant", "content": wrong_sum(q2)}]})
    write("hh_rlhf_harmless_base_test_messages.jsonl", hh)

    stack = []
    for _ in range(25):
        q, a = spelling()
        stack.append({"question": q, "response_j": a, "response_k": "I do not know."})
    write("stack_exchange_paired_tiny.jsonl", stack)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 2-layer Llama3 (tokenizer + HF checkpoint) by ``hlmtune.tiny.write_tiny_assets``."""
    from hlmtune.tiny import write_tiny_assets

    out = tmp_path_factory.mktemp("tiny-llama3")
    write_tiny_assets(out)
    return out


@pytest.fixture(scope="session")
def hlmtune_cli() -> str:
    """Path of the ``hlmtune`` console script of the interpreter running the tests."""
    return HLMTUNE


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    """Every test starts from the same RNG state."""
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover
        pass
