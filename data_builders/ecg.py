"""ECG heartbeat-token dataset for the Heart Language Model.

The builder lives with the tokenizer that writes the shards (``hlmtune.ecg_tokenizer``); it is
re-exported here so configs name every dataset builder the same way:
``dataset: {_component_: hlmtune.data_builders.ecg_tokens_dataset, shards_dir: ...}``.
"""

from hlmtune.ecg_tokenizer.dataset import ECGTokensDataset, ecg_tokens_dataset

__all__ = ["ECGTokensDataset", "ecg_tokens_dataset"]
