"""The shared recipe in-process: one train_step, trainable parameters, NF4 base, metrics."""

from __future__ import annotations

import pytest
import torch

from hlmtune._compat import load_config
from hlmtune.registry import config_path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from hlmtune.tiny import write_tiny_assets

    out = tmp_path_factory.mktemp("tiny")
    write_tiny_assets(out)
    return out


@pytest.fixture
def dist_env(monkeypatch):
    """init_distributed sets RANK/WORLD_SIZE/... for a plain process; undo that afterwards."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    yield


def _recipe(cls_path: str, config: str, tiny_model, text_data_dir, tmp_path, overrides=(), drop=()):
    import importlib

    mod_name, cls_name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(mod_name), cls_name)
    cfg = load_config(str(config_path(config)), [
        f"model_dir={tiny_model}", f"data_dir={text_data_dir}", f"output_dir={tmp_path}", *overrides])
    for key in drop:  # torchtune's `~key` override refuses to drop component sections
        del cfg[key]
    recipe = cls(cfg=cfg)
    recipe.setup(cfg=cfg)
    return recipe


def test_lora_train_step_touches_only_adapters(dist_env, tiny_model, text_data_dir, tmp_path):
    r = _recipe("hlmtune.recipes.lora_finetune_distributed.LoRAFinetuneRecipeDistributed", "tiny_lora",
                tiny_model, text_data_dir, tmp_path, overrides=["lr_scheduler.num_warmup_steps=0"])
    try:
        trainable = {n for n, p in r._model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        batch = next(iter(r._dataloader))
        n_target = int(((batch["labels"][:, 1:]) != -100).sum())
        out = r.train_step(dict(batch))
        assert int(out["num_tokens"]) == n_target
        per_token = float(out["loss_sum"]) / n_target
        assert 5.0 < per_token < 8.0  # ~ln(768) = 6.64 for a fresh model
        grads = {n: p.grad for n, p in r._model.named_parameters() if p.grad is not None}
        assert set(grads) == trainable
        assert any(g.abs().sum() > 0 for g in grads.values())
        # One optimizer step with token normalisation changes the adapters, not the base.
        base = r._model.layers[0].attn.q_proj.weight.detach().clone()
        lora_b = r._model.layers[0].attn.q_proj.lora_b.weight.detach().clone()
        r.finish_gradients(float(out["num_tokens"]))
        r.optimizer_step()
        assert torch.equal(base, r._model.layers[0].attn.q_proj.weight)
        assert not torch.equal(lora_b, r._model.layers[0].attn.q_proj.lora_b.weight)
    finally:
        r.cleanup()


def test_qlora_base_weights_are_nf4(dist_env, tiny_model, text_data_dir, tmp_path):
    from torchao.dtypes.nf4tensor import NF4Tensor

    r = _recipe("hlmtune.recipes.lora_finetune_distributed.LoRAFinetuneRecipeDistributed", "tiny_qlora",
                tiny_model, text_data_dir, tmp_path)
    try:
        q = r._model.layers[0].attn.q_proj
        assert isinstance(q.weight, NF4Tensor)
        assert isinstance(r._model.layers[1].mlp.w1.weight, NF4Tensor)
        assert r.method_name(r._cfg) == "qlora"
        out = r.train_step(dict(next(iter(r._dataloader))))
        assert torch.isfinite(out["loss_sum"])
    finally:
        r.cleanup()


def test_full_finetune_without_checkpointer_trains_from_scratch(dist_env, tiny_model, text_data_dir, tmp_path):
    r = _recipe("hlmtune.recipes.full_finetune_distributed.FullFinetuneRecipeDistributed", "tiny_full",
                tiny_model, text_data_dir, tmp_path, overrides=["max_steps_per_epoch=3"], drop=["checkpointer"])
    try:
        assert r._checkpointer is None and r.method_name(r._cfg) == "pretrain"
        r.train()
        assert (tmp_path / "epoch_0" / "model.pt").exists()
        sd = torch.load(tmp_path / "epoch_0" / "model.pt", weights_only=True)
        assert "layers.0.attn.q_proj.weight" in sd
        assert r.global_step == 3
    finally:
        r.cleanup()
