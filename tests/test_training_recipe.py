"""The shared recipe in-process: one train_step, trainable parameters, NF4 base, metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hlmtune.compat import load_config
from hlmtune.registry import config_path


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


def test_selective_activation_checkpointing_wraps_every_nth_layer(dist_env, tiny_model, text_data_dir, tmp_path):
    """ac_mode/ac_option as torchtune's full_finetune_distributed reads them; same loss and grads."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    cls = "hlmtune.recipes.full_finetune_distributed.FullFinetuneRecipeDistributed"
    results = {}
    for name, overrides in (("off", []), ("every2", ["ac_mode=selective", "ac_option=2"]), ("full", ["ac_mode=full"])):
        r = _recipe(cls, "tiny_full", tiny_model, text_data_dir, tmp_path / name, overrides=["batch_size=2", *overrides])
        try:
            wrapped = [isinstance(layer, CheckpointWrapper) for layer in r._model.layers]
            out = r.train_step(dict(next(iter(r._dataloader))))
            grad = r._model.tok_embeddings.weight.grad.detach().clone()
            results[name] = (wrapped, float(out["loss_sum"]), grad)
        finally:
            r.cleanup()
    assert results["off"][0] == [False, False]
    assert results["every2"][0] == [False, True]  # layers N-1, 2N-1, ...: the 2nd of 2
    assert results["full"][0] == [True, True]
    for name in ("every2", "full"):  # recomputation changes memory, not numbers (beyond fp32 rounding:
        # oneDNN's GEMM, where the recipe takes it, may round a recomputed product in another order)
        assert results[name][1] == pytest.approx(results["off"][1], rel=1e-6)
        ref = results["off"][2]
        assert torch.allclose(results[name][2], ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))


def test_log_peak_memory_stats_false_turns_memory_metrics_off(dist_env, tiny_model, text_data_dir, tmp_path):
    cls = "hlmtune.recipes.lora_finetune_distributed.LoRAFinetuneRecipeDistributed"
    for flag, expect in (("True", True), ("False", False)):
        r = _recipe(cls, "tiny_lora", tiny_model, text_data_dir, tmp_path / flag,
                    overrides=["batch_size=2", f"log_peak_memory_stats={flag}"])
        try:
            metrics = r._one_optimizer_step(iter(r._dataloader))
            assert ("peak_rss_gib" in metrics) is expect and ("peak_rss_gib_rank0" in metrics) is expect
            assert metrics["loss"] > 0 and "tokens_per_second" in metrics
        finally:
            r.cleanup()


def test_activation_checkpointing_auto_checkpoints_what_the_budget_needs(dist_env, tiny_model, text_data_dir, tmp_path):
    """auto: a generous budget checkpoints nothing, a tight one the bottom layers; same loss and
    gradients as no checkpointing (recomputation changes memory, not numbers)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    cls = "hlmtune.recipes.lora_finetune_distributed.LoRAFinetuneRecipeDistributed"
    results = {}
    for name, overrides in (("off", []), ("on", ["enable_activation_checkpointing=True"]), ("auto_big", ["enable_activation_checkpointing=auto", "ac_auto_budget_gib=50"]),
                            ("auto_tiny", ["enable_activation_checkpointing=auto", "ac_auto_budget_gib=0.0001"])):
        r = _recipe(cls, "tiny_lora", tiny_model, text_data_dir, tmp_path / name,
                    overrides=["batch_size=2", "lr_scheduler.num_warmup_steps=0", *overrides])
        try:
            wrapped = [isinstance(layer, CheckpointWrapper) for layer in r._model.layers]
            out = r.train_step(dict(next(iter(r._dataloader))))
            grad = r._model.layers[0].attn.q_proj.lora_a.weight.grad.detach().clone()
            results[name] = (wrapped, float(out["loss_sum"]), grad)
        finally:
            r.cleanup()
    assert results["off"][0] == [False, False]
    assert results["on"][0] == [True, True]  # LoRA adapters load into wrapped layers (they failed to before)
    assert results["auto_big"][0] == [False, False]
    assert results["auto_tiny"][0] == [True, True]  # does not fit at all: every layer, with a warning
    for name in ("on", "auto_big", "auto_tiny"):
        assert results[name][1] == pytest.approx(results["off"][1], rel=1e-6)
        assert torch.allclose(results[name][2], results["off"][2], rtol=1e-5, atol=1e-8)


def test_more_steps_per_epoch_than_the_epoch_holds_is_said(dist_env, tiny_model, text_data_dir, tmp_path, caplog):
    """max_steps_per_epoch beyond the epoch: the epoch ends first, and the run says so."""
    import logging

    with caplog.at_level(logging.WARNING):
        r = _recipe("hlmtune.recipes.full_finetune_distributed.FullFinetuneRecipeDistributed", "tiny_full",
                    tiny_model, text_data_dir, tmp_path, overrides=["max_steps_per_epoch=1000000"], drop=["checkpointer"])
    try:
        assert r._steps_per_epoch == len(r._dataloader) < 1000000
        assert f"max_steps_per_epoch 1000000 > the {r._steps_per_epoch} optimizer steps of an epoch" in caplog.text
    finally:
        r.cleanup()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        r = _recipe("hlmtune.recipes.full_finetune_distributed.FullFinetuneRecipeDistributed", "tiny_full",
                    tiny_model, text_data_dir, tmp_path / "b", overrides=["max_steps_per_epoch=3"], drop=["checkpointer"])
    try:
        assert r._steps_per_epoch == 3 and "max_steps_per_epoch" not in caplog.text
    finally:
        r.cleanup()


@pytest.mark.parametrize("onednn", ["0", "1"])
def test_cpu_model_takes_blocked_attention_and_onednn_where_asked(dist_env, tiny_model, text_data_dir, tmp_path,
                                                                 monkeypatch, onednn):
    """The recipe's CPU build: attention in query blocks and oneDNN's GEMMs as the probes decide (forced here)."""
    from hlmtune.training import fastpath

    monkeypatch.setenv("HLM_ONEDNN_LINEAR", onednn)
    monkeypatch.setenv("HLM_BLOCKED_ATTENTION", "1")
    fastpath.onednn_linear_decision.cache_clear()
    try:
        r = _recipe("hlmtune.recipes.lora_finetune_distributed.LoRAFinetuneRecipeDistributed", "tiny_lora",
                    tiny_model, text_data_dir, tmp_path, overrides=["batch_size=2"])
        try:
            attn = r._model.layers[0].attn
            assert attn._causal_block == fastpath.CAUSAL_BLOCK
            k_proj = attn.k_proj  # a plain nn.Linear (LoRA is on q, v and the MLP here)
            assert type(k_proj) is torch.nn.Linear
            routed = "forward" in k_proj.__dict__ and k_proj.forward.__func__ is fastpath._onednn_linear_forward
            assert routed is (onednn == "1" and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
            assert getattr(attn.q_proj, "_onednn_base", False) is routed  # the LoRA base product too
            # the run says which library it multiplied with (run.json), decided at the model's build
            assert r._cpu_linear == ("onednn" if routed else "mkl")
            assert r._cpu_linear_why == f"HLM_ONEDNN_LINEAR={onednn}: {'oneDNN' if routed else 'MKL'} (no probe)"
            out = r.train_step(dict(next(iter(r._dataloader))))
            assert torch.isfinite(out["loss_sum"])
        finally:
            r.cleanup()
    finally:
        fastpath.onednn_linear_decision.cache_clear()


def test_the_gemm_probe_times_the_model_s_own_layers(dist_env, tiny_model, text_data_dir, tmp_path, monkeypatch):
    """Unforced, the recipe asks the oneDNN probe once, at the built model's layer shapes, and honours it."""
    from hlmtune.training import fastpath, recipe

    monkeypatch.delenv("HLM_ONEDNN_LINEAR", raising=False)
    monkeypatch.setenv("HLM_BLOCKED_ATTENTION", "0")
    asked = []

    def decision(shapes):
        asked.append(shapes)
        return True, "probed at the model's shapes"

    monkeypatch.setattr(recipe, "onednn_linear_decision", decision)
    r = _recipe("hlmtune.recipes.lora_finetune_distributed.LoRAFinetuneRecipeDistributed", "tiny_lora",
                tiny_model, text_data_dir, tmp_path, overrides=["batch_size=2",
                "metric_logger._component_=hlmtune.profiling.collector.CollectorLogger"])
    try:
        assert asked == [fastpath.linear_shapes(r._inner_model)]  # once, at the model it builds
        k_proj = r._model.layers[0].attn.k_proj
        assert k_proj.forward.__func__ is fastpath._onednn_linear_forward  # honoured
        assert r._cpu_linear == "onednn" and r._fast_paths["onednn_linear"] == "probed at the model's shapes"
    finally:
        r.cleanup()
    run = json.loads((Path(r._metric_logger.log_dir) / "run.json").read_text())
    assert run["cpu_linear"] == "onednn" and run["cpu_linear_why"] == "probed at the model's shapes"


def test_the_dataloaders_set_vital_deprecation_is_not_printed():
    """torchdata's loader calls the deprecated torch.set_vital on construction: not the user's
    problem, so the recipes' import drops that one warning (others still show)."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    from hlmtune.training.recipe import quiet_known_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_known_warnings()
        StatefulDataLoader(list(range(4)), batch_size=2)
        warnings.warn("another warning", UserWarning)
    texts = [str(w.message) for w in seen]
    assert "another warning" in texts and not any("set_vital" in t for t in texts), texts



def _first_loss(dist_env, tiny_model, text_data_dir, tmp_path, monkeypatch, onednn: str, blocked: str):
    from hlmtune.training import fastpath

    monkeypatch.setenv("HLM_ONEDNN_LINEAR", onednn)
    monkeypatch.setenv("HLM_BLOCKED_ATTENTION", blocked)
    fastpath.onednn_linear_decision.cache_clear()
    try:
        r = _recipe("hlmtune.recipes.lora_finetune_distributed.LoRAFinetuneRecipeDistributed", "tiny_lora",
                    tiny_model, text_data_dir, tmp_path / f"o{onednn}b{blocked}",
                    # packed: rows of 512 whether the real samples or the shorter stand-ins are read
                    overrides=["batch_size=2", "tokenizer.max_seq_len=512", "dataset.packed=True",
                               "metric_logger._component_=hlmtune.profiling.collector.CollectorLogger"])
        try:
            attn = r._model.layers[0].attn
            assert (getattr(attn, "_causal_block", 0) == fastpath.CAUSAL_BLOCK) is (blocked == "1")  # honoured
            assert r._cpu_attention == ("blocked" if blocked == "1" else "sdpa")
            assert r._cpu_attention_why == f"HLM_BLOCKED_ATTENTION={blocked} (no probe)"
            # oneDNN is honoured whatever the attention probe said (it was skipped with one SDPA
            # call before 2026-12-02), and run.json names every fast path taken, with why
            k_proj = attn.k_proj
            routed = "forward" in k_proj.__dict__ and k_proj.forward.__func__ is fastpath._onednn_linear_forward
            assert routed is (onednn == "1" and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
            assert ("onednn_linear" in r._fast_paths) is routed
            assert ("blocked_attention" in r._fast_paths) is (blocked == "1")
            assert {"addmm_lora", "complex_rope", "gqa_attention"} <= set(r._fast_paths)
            assert all(isinstance(v, str) and v for v in r._fast_paths.values())
            batch = dict(next(iter(r._dataloader)))
            assert batch["tokens"].shape[1] >= 2 * fastpath.CAUSAL_BLOCK  # long enough for the blocks to run
            out = r.train_step(batch)
            loss = float(out["loss_sum"]) / float(out["num_tokens"])
        finally:
            r.cleanup()
        run = json.loads((Path(r._metric_logger.log_dir) / "run.json").read_text())
        assert run["fast_paths"] == r._fast_paths  # run.json names them, with why
        return loss
    finally:
        fastpath.onednn_linear_decision.cache_clear()


def test_losses_agree_whichever_path_the_probes_pick(dist_env, tiny_model, text_data_dir, tmp_path, monkeypatch):
    """The CPU fast paths change the summation order only: first-step loss equal within 1e-5 (README)."""
    ref = _first_loss(dist_env, tiny_model, text_data_dir, tmp_path, monkeypatch, "0", "0")
    for onednn, blocked in (("0", "1"), ("1", "0"), ("1", "1")):
        got = _first_loss(dist_env, tiny_model, text_data_dir, tmp_path, monkeypatch, onednn, blocked)
        assert got == pytest.approx(ref, rel=1e-5), (onednn, blocked)
