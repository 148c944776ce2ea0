"""The Heart Language Model (HLM): a Llama3-architecture language model of heartbeat tokens.

Where things live:

============================  ==================================================================
``hlmtune.hlm.model``         model builders ``hlm_1m`` / ``hlm_10m`` / ``hlm_100m`` and their
                              ``lora_`` / ``qlora_`` variants (``model._component_`` targets)
``hlmtune.ecg_tokenizer.splits``        MIT-BIH inter-patient split (DS1 trains, DS2 tests), split files,
                              the train/test overlap guard, the random beat split
``hlmtune.data_builders.ecg`` datasets: pretraining windows, beat classification, atrial
                              fibrillation, DPO pairs (``dataset._component_`` targets)
``hlmtune.hlm.evaluate``      ``hlmtune eval``: per-class Se / +P / F1, confusion matrix, the
                              published inter-patient baselines beside ours
``hlmtune.hlm.pipeline``      ``hlmtune demo``: data -> tokenize -> pretrain -> LoRA -> eval -> report
``hlmtune.hlm.cv``            ``hlmtune cv``: patient-wise K-fold cross-validation over the training
                              patients (model selection without DS2), pooled out-of-fold
                              predictions
``hlmtune.hlm.calibrate``     class bias on the class log-probabilities, fitted on those only
============================  ==================================================================

The tokenizer that writes the heartbeat tokens is :mod:`hlmtune.ecg_tokenizer`.
See ``docs/hlm.md``.
"""
