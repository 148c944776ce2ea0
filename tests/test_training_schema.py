"""Config validation: unknown keys and typos name the closest key; components match signatures."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hlmtune.compat import load_config
from hlmtune.registry import config_path
from hlmtune.training.schema import (
    RECIPE_KEYS, ConfigError, build_model_on_meta, config_warnings, resolve_component, validate_config,
)


@pytest.fixture
def tiny_cfg(monkeypatch, tmp_path):
    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    return load_config(str(config_path("tiny_lora")), [])


def test_tiny_config_is_valid(tiny_cfg):
    validate_config(tiny_cfg, "lora_finetune_distributed")


@pytest.mark.parametrize("override,needle", [
    ("batch_sise=2", "did you mean 'batch_size'"),
    ("optimizer.lrr=1e-3", "did you mean 'lr'"),
    ("model.lora_rnak=4", "did you mean 'lora_rank'"),
    ("data_loader.pin_memroy=True", "did you mean 'data_loader.pin_memory'"),
    ("data_parallel=fdsp", "did you mean 'fsdp'"),
    ("model._component_=torchtune.models.llama3.lora_llama4", "did you mean 'lora_llama3'"),
    ("dtype=fp16", "dtype must be"),
    ("batch_size=0", "positive integer"),
    ("data_loader.split=round_robin", "data_loader.split"),
    ("keep_last_n_checkpoints=0", "keep_last_n_checkpoints must be a positive integer"),
    # a profiler section without _component_ is built as torchtune's default: checked as one
    ("profiler.enabeld=True", "profiler.enabeld: torchtune.training.setup_torch_profiler has no argument 'enabeld' "
                              "(did you mean 'enabled'?)"),
])
def test_bad_overrides_are_named(monkeypatch, tmp_path, override, needle):
    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    cfg = load_config(str(config_path("tiny_lora")), [override])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, "lora_finetune_distributed")
    assert needle in str(e.value)


def test_all_problems_reported_at_once(tiny_cfg):
    cfg = OmegaConf.merge(tiny_cfg, {"foo": 1, "bar": 2})
    del cfg["seed"]
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, "lora_finetune_distributed")
    msg = str(e.value)
    assert "'foo'" in msg and "'bar'" in msg and "missing required key 'seed'" in msg


def test_recipe_specific_keys(tiny_cfg):
    assert "ref_checkpointer" in RECIPE_KEYS["full_dpo_distributed"]
    assert "quantizer" in RECIPE_KEYS["qat_distributed"]
    with pytest.raises(ConfigError, match="unknown recipe"):
        validate_config(tiny_cfg, "lora_finetune_distribute")
    # Required by the spec: QAT needs a quantizer, DPO a checkpointer; full fine-tuning neither.
    cfg = OmegaConf.merge(tiny_cfg, {})
    del cfg["checkpointer"]
    with pytest.raises(ConfigError, match="missing required key 'checkpointer'"):
        validate_config(cfg, "lora_dpo_distributed")
    with pytest.raises(ConfigError, match="missing required key 'quantizer'"):
        validate_config(cfg, "qat_distributed", check_components=False)
    with pytest.raises(ConfigError) as e:
        validate_config(OmegaConf.merge(cfg, {"optimizer_in_bwd": True}), "full_finetune_distributed", check_components=False)
    assert "not supported" in str(e.value) and "checkpointer" not in str(e.value)


def test_other_recipes_keys_warn_and_typos_still_fail(tiny_cfg):
    """A config torchtune's recipe runs must run here: keys another torchtune recipe reads
    (or this recipe's torchtune twin reads but the pack does not implement) are warnings."""
    cfg = OmegaConf.merge(tiny_cfg, {"ref_checkpointer": None, "ac_mode": "full", "optimizer_in_bwd": True,
                                      "enable_async_checkpointing": False, "low_cpu_ram": True})
    validate_config(cfg, "lora_finetune_distributed")
    warnings = config_warnings(cfg, "lora_finetune_distributed")
    keys = ("ref_checkpointer", "ac_mode", "optimizer_in_bwd", "enable_async_checkpointing", "low_cpu_ram")
    for key in keys:
        assert sum(f"key '{key}'" in w for w in warnings) == 1, warnings
    assert len(warnings) == len(keys)
    full = OmegaConf.merge(tiny_cfg, {"enable_async_checkpointing": True, "tensor_parallel_plan": {"_component_": "x"},
                                       "save_adapter_weights_only": False})
    warnings = config_warnings(full, "full_finetune_distributed")
    assert [w.split("'")[1] for w in warnings] == ["save_adapter_weights_only", "enable_async_checkpointing", "tensor_parallel_plan"]
    quiet = OmegaConf.merge(tiny_cfg, {"enable_async_checkpointing": False, "tensor_parallel_plan": None})
    assert [w.split("'")[1] for w in config_warnings(quiet, "full_finetune_distributed")] == ["save_adapter_weights_only"]
    with pytest.raises(ConfigError, match="did you mean 'ac_mode'"):
        validate_config(OmegaConf.merge(tiny_cfg, {"ac_mdoe": "full"}), "full_finetune_distributed", check_components=False)
    with pytest.raises(ConfigError, match="ac_mode must be one of"):
        validate_config(OmegaConf.merge(tiny_cfg, {"ac_mode": "partial"}), "full_finetune_distributed", check_components=False)


def test_interpolated_top_level_keys_are_config_variables(tiny_cfg):
    """Folder variables such as ECG configs' ${shards_dir} are accepted when referenced."""
    cfg = OmegaConf.merge(tiny_cfg, {"shards_dir": "/data/shards"})
    with pytest.raises(ConfigError, match="unknown key 'shards_dir'"):
        validate_config(cfg, "lora_finetune_distributed", check_components=False)
    cfg.dataset.data_files = "${shards_dir}/x.jsonl"
    validate_config(cfg, "lora_finetune_distributed", check_components=False)


def test_missing_required_component_argument(tiny_cfg):
    cfg = OmegaConf.merge(tiny_cfg, {})
    del cfg.model["vocab_size"]
    with pytest.raises(ConfigError, match="needs 'vocab_size'"):
        validate_config(cfg, "lora_finetune_distributed")


def test_resolve_component():
    from torchtune.models.llama3 import lora_llama3_8b

    assert resolve_component("torchtune.models.llama3.lora_llama3_8b") is lora_llama3_8b
    with pytest.raises(ConfigError, match="has no"):
        resolve_component("torchtune.models.llama3.nope")


def test_build_model_on_meta_counts_8b_without_memory():
    n = build_model_on_meta(OmegaConf.create({"_component_": "torchtune.models.llama3.llama3_8b"}), "bf16")
    assert 8.0e9 < n < 8.1e9


def test_checkpointer_resume_keys_warn_that_the_pack_resumes_its_own_way(tiny_cfg):
    """The recipes hand torchtune's checkpointer resume_from_checkpoint=False and keep their own
    state: a resume asked of the checkpointer would silently start afresh, so it is named."""
    cfg = OmegaConf.merge(tiny_cfg, {"checkpointer": {"resume_from_checkpoint": True, "recipe_checkpoint": "r.pt"}})
    validate_config(cfg, "lora_finetune_distributed", check_components=False)
    got = [w for w in config_warnings(cfg, "lora_finetune_distributed") if "checkpointer." in w]
    assert got == [
        "key 'checkpointer.resume_from_checkpoint' (True) is ignored: the pack's recipes resume from their own "
        "checkpoints; set the top-level resume_from_checkpoint=True",
        "key 'checkpointer.recipe_checkpoint' ('r.pt') is ignored: the pack's recipes keep their state in "
        "output_dir/checkpoints (resume_from_checkpoint=True)"]
    assert not [w for w in config_warnings(tiny_cfg, "lora_finetune_distributed") if "checkpointer." in w]


def test_compile_mode_warns_where_it_cannot_act(tiny_cfg):
    """compile_mode without compile, or CUDA graphs on CPU: one warning line; a bad mode fails."""
    off = OmegaConf.merge(tiny_cfg, {"compile_mode": "reduce-overhead", "compile": False})
    validate_config(off, "lora_finetune_distributed", check_components=False)
    assert [w for w in config_warnings(off, "lora_finetune_distributed") if "compile_mode" in w] == [
        "key 'compile_mode' ('reduce-overhead') is ignored: compile is not True"]
    cpu = OmegaConf.merge(tiny_cfg, {"compile_mode": "reduce-overhead", "compile": True, "device": "cpu"})
    assert any("none on cpu" in w for w in config_warnings(cpu, "lora_finetune_distributed"))
    cuda = OmegaConf.merge(tiny_cfg, {"compile_mode": "reduce-overhead", "compile": True, "device": "cuda"})
    assert not any("compile_mode" in w for w in config_warnings(cuda, "lora_finetune_distributed"))
    with pytest.raises(ConfigError, match="compile_mode must be one of"):
        validate_config(OmegaConf.merge(tiny_cfg, {"compile_mode": "fast"}), "lora_finetune_distributed",
                        check_components=False)


def test_activation_checkpointing_auto_keys(tiny_cfg):
    """auto is accepted with its budget; a budget without auto warns; bad values fail naming the key."""
    auto = OmegaConf.merge(tiny_cfg, {"enable_activation_checkpointing": "auto", "ac_auto_budget_gib": 12})
    opts = validate_config(auto, "lora_finetune_distributed", check_components=False)
    assert opts.activation_checkpointing.auto and opts.activation_checkpointing.budget_gib == 12.0
    assert not any("ac_auto_budget_gib" in w for w in config_warnings(auto, "lora_finetune_distributed"))
    off = OmegaConf.merge(tiny_cfg, {"enable_activation_checkpointing": True, "ac_auto_budget_gib": 12})
    assert "key 'ac_auto_budget_gib' (12) is ignored: enable_activation_checkpointing is not 'auto'" in \
        config_warnings(off, "lora_finetune_distributed")
    for bad, needle in (({"enable_activation_checkpointing": "sometimes"}, "must be True, False or 'auto'"),
                        ({"enable_activation_checkpointing": "auto", "ac_auto_budget_gib": -1}, "ac_auto_budget_gib must be a positive"),
                        ({"enable_activation_checkpointing": "auto", "ac_auto_budget_gib": "8G"}, "ac_auto_budget_gib must be a positive"),
                        ({"enable_activation_checkpointing": "auto", "ac_auto_budget_gib": 1, "ac_auto_budgte_gib": 2},
                         "did you mean 'ac_auto_budget_gib'")):
        with pytest.raises(ConfigError, match=needle):
            validate_config(OmegaConf.merge(tiny_cfg, bad), "lora_finetune_distributed", check_components=False)
    with pytest.raises(ConfigError, match="both set: choose one"):
        validate_config(OmegaConf.merge(tiny_cfg, {"enable_activation_checkpointing": "auto", "ac_mode": "full"}),
                        "full_finetune_distributed", check_components=False)


@pytest.mark.parametrize("config,recipe,needles", [
    # A LoRA model and an SFT dataset under full-weight DPO: both named, before any run.
    ("tiny_lora", "full_dpo_distributed", ["lora_llama3 is a LoRA builder", "needs preference pairs"]),
    ("tiny_lora", "lora_dpo_distributed", ["needs preference pairs"]),
    ("tiny_full", "lora_finetune_distributed", ["builds no LoRA adapters"]),
    ("tiny_lora_dpo", "lora_finetune_distributed", ["returns preference pairs"]),
    ("ecg_lora", "lora_dpo_distributed", ["ECGBeatClassificationDataset", "needs preference pairs"]),
])
def test_recipe_paired_with_the_wrong_model_or_data_is_refused(monkeypatch, tmp_path, config, recipe, needles):
    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    cfg = load_config(str(config_path(config)), [])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, recipe)
    for needle in needles:
        assert needle in str(e.value)


@pytest.mark.parametrize("config,recipe", [
    ("tiny_lora", "lora_finetune_distributed"), ("tiny_full", "full_finetune_distributed"),
    ("tiny_lora_dpo", "lora_dpo_distributed"), ("tiny_full_dpo", "full_dpo_distributed"),
    ("tiny_qat_lora", "qat_lora_finetune_distributed"), ("tiny_qat", "qat_distributed"),
    ("ecg_pretrain", "full_finetune_distributed"), ("ecg_dpo", "lora_dpo_distributed"),
])
def test_matching_pairs_pass_the_pairing_check(monkeypatch, tmp_path, config, recipe):
    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    validate_config(load_config(str(config_path(config)), []), recipe)


def test_sequences_longer_than_the_model_context_are_named(monkeypatch, tmp_path):
    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    path = str(config_path("ecg_pretrain"))
    with pytest.raises(ConfigError) as e:  # the builder's default context (hlm_1m: 1024) when the config gives none
        validate_config(load_config(path, ["dataset.max_seq_len=2048", "~model.max_seq_len"]), "full_finetune_distributed")
    assert "dataset.max_seq_len: 2048 is longer than the model's context (model.max_seq_len = 1024, the default" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(path, ["tokenizer.max_seq_len=1025"]), "full_finetune_distributed")
    assert "tokenizer.max_seq_len: 1025" in str(e.value)
    # Equal lengths, or a longer model context, pass.
    validate_config(load_config(path, ["dataset.max_seq_len=1024"]), "full_finetune_distributed")
    validate_config(load_config(path, ["dataset.max_seq_len=2048", "model.max_seq_len=2048", "tokenizer.max_seq_len=2048"]),
                    "full_finetune_distributed")


def test_each_dataset_of_a_list_is_checked_under_its_own_key(monkeypatch, tmp_path):
    """A ConcatDataset config (a list): pairing and length problems name the item (dataset[i])."""
    monkeypatch.setenv("HLM_DATA", str(tmp_path))
    base = load_config(str(config_path("tiny_lora")), [])
    sft = OmegaConf.to_container(base.dataset)
    pref = OmegaConf.to_container(load_config(str(config_path("tiny_lora_dpo")), []).dataset)
    cfg = OmegaConf.merge(base, {})
    cfg.dataset = [sft, {**pref}]
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, "lora_finetune_distributed")
    assert "dataset[1]._component_: hlmtune.data_builders.hh_rlhf_dataset returns preference pairs" in str(e.value)
    assert "dataset[0]" not in str(e.value)
    cfg.dataset = [sft, {**sft, "max_seq_len": 4096}]
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, "lora_finetune_distributed")
    assert "dataset[1].max_seq_len: 4096 is longer than the model's context" in str(e.value)


@pytest.mark.parametrize("config,recipe,override,needle", [
    ("ecg_lora", "lora_finetune_distributed", "dataset.long_rr=-3", "dataset: long_rr must be 0 (off)"),
    ("ecg_lora", "lora_finetune_distributed", "dataset.rr_reference=gatd", "dataset: rr_reference must be one of"),
    ("ecg_lora", "lora_finetune_distributed", "dataset.template_delta=True dataset.template_beats=0",
     "dataset: template_delta shows the beat minus"),
    ("ecg_dpo", "lora_dpo_distributed", "dataset.premature_synth=3", "dataset: premature_synth must be 0..1"),
    ("ecg_lora", "lora_finetune_distributed", "dataset.normalized_rr=null", "(null: normalized_rr)"),
])
def test_beat_option_values_are_checked_before_any_data_exists(monkeypatch, tmp_path, config, recipe, override, needle):
    """The beat builders' range checks run at validation (no shards, no manifest), naming the section."""
    monkeypatch.setenv("HLM_DATA", str(tmp_path / "nothing_here"))
    validate_config(load_config(str(config_path(config)), []), recipe)
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(str(config_path(config)), override.split()), recipe)
    assert needle in str(e.value)
