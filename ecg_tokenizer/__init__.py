"""ECG tokenizer: WFDB records -> heartbeat tokens for the Heart Language Model.

Modules: ``records`` (read + validate), ``core`` (fast vectorised tokenizer),
``reference`` (slow per-beat reference), ``resample``, ``vocab`` (parameters, vocabulary,
quantizers), ``labels``, ``detector`` (R peaks, Se/+P), ``shards`` (files, manifest),
``pipeline`` (parallel directory runs), ``tokenizer`` (torchtune tokenizer), ``dataset``
(training dataset), ``synth`` (synthetic WFDB), ``cli``. See docs/ecg_tokenizer.md.

Names below are imported lazily so ``hlmtune --help`` does not import numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TokenizerParams": "vocab",
    "Vocabulary": "vocab",
    "RecordError": "records",
    "EcgRecord": "records",
    "load_record": "records",
    "tokenize_record": "core",
    "tokenize_record_reference": "reference",
    "RecordOptions": "pipeline",
    "RunSummary": "pipeline",
    "tokenize_directory": "pipeline",
    "ECGTokenizer": "tokenizer",
    "ecg_tokenizer": "tokenizer",
    "ECGTokensDataset": "dataset",
    "ecg_tokens_dataset": "dataset",
    "write_synthetic_database": "synth",
    "read_manifest": "shards",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
