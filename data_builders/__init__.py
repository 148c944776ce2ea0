"""Dataset builders (``_component_`` targets) and the token-count report.

Text builders: alpaca-cleaned, grammar (C4_200M), samsum, slimorca and
preference pairs (stack-exchange paired, HH-RLHF). See ``docs/data_builders.md``.

Names are exported lazily (PEP 562 ``__getattr__``): ``import hlmtune.data_builders.cli``, done
by every ``hlmtune`` command, must not import torch/torchtune through this ``__init__``.
``from hlmtune.data_builders import samsum_dataset`` and YAML ``_component_:
hlmtune.data_builders.samsum_dataset`` import the defining module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List

# public name -> defining submodule
_EXPORTS: Dict[str, str] = {
    # loading.py: row validation, bad-row policy, subsets
    "BadRowError": "loading",
    "PreparedRows": "loading",
    "check_message_list": "loading",
    "check_text_field": "loading",
    "prepare_rows": "loading",
    # sft.py: SFT builders
    "GRAMMAR_TEMPLATE": "sft",
    "SUMMARIZE_TEMPLATE": "sft",
    "TemplatedMessages": "sft",
    "ValidatedSFTDataset": "sft",
    "alpaca_cleaned_dataset": "sft",
    "grammar_dataset": "sft",
    "resolve_template": "sft",
    "samsum_dataset": "sft",
    "slimorca_dataset": "sft",
    # preference.py: DPO pairs
    "HHToMessages": "preference",
    "PromptResponsesToMessages": "preference",
    "ValidatedPreferenceDataset": "preference",
    "hh_rlhf_dataset": "preference",
    "parse_hh_transcript": "preference",
    "stack_exchange_paired_dataset": "preference",
    # report.py: token-count report
    "BUILDERS": "report",
    "COLUMNS": "report",
    "TEMPLATES": "report",
    "format_report": "report",
    "resolve_tokenizer": "report",
    "token_count_report": "report",
    "write_report_json": "report",
}

# ecg.py: the Heart Language Model's datasets (ecg_tokens_dataset lives in hlmtune.ecg_tokenizer.dataset)
_EXPORTS.update({
    name: "ecg" for name in (
        "ecg_tokens_dataset", "ECGTokensDataset", "ecg_pretrain_dataset", "ecg_beat_classification_dataset",
        "ecg_beat_stream_dataset", "ECGBeatStreamDataset",
        "ecg_beat_dpo_dataset", "ecg_af_dataset", "ECGBeatClassificationDataset", "ECGBeatPreferenceDataset",
        "ECGAFDataset",
    )
})

__all__: List[str] = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # cache: next access skips __getattr__
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))
