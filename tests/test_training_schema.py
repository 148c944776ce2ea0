"""Config validation: unknown keys and typos name the closest key; components match signatures."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hlmtune._compat import load_config
from hlmtune.registry import config_path
from hlmtune.training.schema import ConfigError, RECIPE_KEYS, build_model_on_meta, resolve_component, validate_config


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
    ("data_loader.pin_memroy=True", "did you mean 'pin_memory'"),
    ("data_parallel=fdsp", "did you mean 'fsdp'"),
    ("model._component_=torchtune.models.llama3.lora_llama4", "did you mean 'lora_llama3'"),
    ("dtype=fp16", "dtype must be"),
    ("batch_size=0", "positive integer"),
    ("data_loader.split=round_robin", "data_loader.split"),
    ("optimizer_in_bwd=True", "not supported"),
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
    cfg = OmegaConf.merge(tiny_cfg, {"ref_checkpointer": None})
    with pytest.raises(ConfigError, match="ref_checkpointer"):
        validate_config(cfg, "lora_finetune_distributed")
    assert "ref_checkpointer" in RECIPE_KEYS["full_dpo_distributed"]
    assert "quantizer" in RECIPE_KEYS["qat_distributed"]
    with pytest.raises(ConfigError, match="unknown recipe"):
        validate_config(tiny_cfg, "lora_finetune_distribute")


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
