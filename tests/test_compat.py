"""The torchtune/torchao compatibility layer."""

from __future__ import annotations

from hlmtune import _compat


def test_load_config_applies_overrides_like_tune_run(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("a: 1\nmodel:\n  _component_: x.y\n  n: 2\nkeep: 3\n")
    cfg = _compat.load_config(str(f), ["a=5", "model=x.z", "model.n=4", "~keep"])
    assert cfg.a == 5 and cfg.model._component_ == "x.z" and cfg.model.n == 4 and "keep" not in cfg


def test_special_tokens_and_fake_quant_toggles():
    tokens = _compat.llama3_special_tokens()
    assert tokens["<|begin_of_text|>"] == 128000 and len(tokens) == 256
    disable, enable = _compat.fake_quant_toggles("8da4w-qat")
    assert callable(disable) and callable(enable)


def test_torchao_alias_is_idempotent():
    from torchao.quantization import qat

    _compat.ensure_torchao_aliases()
    _compat.ensure_torchao_aliases()
    assert hasattr(qat, "FakeQuantizeConfig")


def test_builtin_recipes_listing():
    recipes, root = _compat.builtin_recipes()
    names = {r.name for r in recipes}
    assert "lora_finetune_single_device" in names and (root / "configs").is_dir()
