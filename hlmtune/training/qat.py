"""Quantization-aware training: fake quantization during training, real quantization after.

The QAT quantizer (e.g. ``torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer``:
int8 per-token dynamic activations, int4 grouped weights) swaps linears for fake-quantized
ones before sharding. After the last epoch, rank 0 rebuilds the plain model on CPU, loads the
exported weights, and ``convert`` turns it into a model with int4 weights (stored in int8
with per-group scales) and int8 dynamic activations, written as
``<output_dir>/quantized/model-<mode>.pt``, reloaded and run once to prove it works.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Dict

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, training, utils

from hlmtune.compat import ensure_torchao_aliases, fake_quant_toggles
from hlmtune.files import atomic_torch_save

log = utils.get_logger("INFO")


def base_model_config(cfg_model: DictConfig) -> DictConfig:
    """The non-LoRA model config matching a LoRA builder config.

    torchtune names LoRA builders ``lora_<base>`` next to ``<base>`` and gives them the base
    builder's arguments plus LoRA ones, so ``lora_llama3_8b(lora_rank=8, ...)`` maps to
    ``llama3_8b()`` and ``lora_llama3(vocab_size=..., lora_rank=8)`` to ``llama3(vocab_size=...)``.

    Args:
        cfg_model (DictConfig): the ``model`` section.

    Returns:
        DictConfig: a config for the plain model.
    """
    comp = str(cfg_model._component_)
    mod, _, fn = comp.rpartition(".")
    if fn.startswith("lora_"):
        fn = fn[len("lora_"):]
    drop = ("lora_", "apply_lora", "quantize_base", "use_dora")
    kept = {k: v for k, v in OmegaConf.to_container(cfg_model, resolve=True).items()
            if k != "_component_" and not k.startswith(drop)}
    return OmegaConf.create({"_component_": f"{mod}.{fn}", **kept})


class QATMixin:
    """Mixed into a recipe (listed first): fake quantization, delayed start, final quantize."""

    def prepare_model(self, model: torch.nn.Module, cfg: DictConfig) -> torch.nn.Module:
        """Swap linears for fake-quantized ones (QAT-LoRA overrides this for LoRA linears)."""
        quantizer = self._make_quantizer(cfg.quantizer)
        model = quantizer.prepare(model)
        self._maybe_delay_fake_quant(model)
        return model

    def _make_quantizer(self, cfg_quantizer: DictConfig) -> Any:
        ensure_torchao_aliases()
        quantizer = config.instantiate(cfg_quantizer)
        quantizer.precision = self._dtype
        mode = training.quantization.get_quantizer_mode(quantizer)
        if mode is None or "qat" not in mode:
            raise ValueError(f"quantizer {cfg_quantizer._component_} is not a QAT quantizer (mode {mode!r})")
        self._quantizer_mode = mode
        return quantizer

    def _maybe_delay_fake_quant(self, model: torch.nn.Module) -> None:
        n = self._cfg.get("fake_quant_after_n_steps", None)
        if n is not None and n > 0:
            disable, _ = fake_quant_toggles(self._quantizer_mode)
            model.apply(disable)
            self._fake_quant_on = False

    def on_step_start(self) -> None:
        """Switch fake quantization on once ``fake_quant_after_n_steps`` steps are done."""
        n = self._cfg.get("fake_quant_after_n_steps", None)
        if n is not None and not getattr(self, "_fake_quant_on", True) and self.global_step >= n:
            _, enable = fake_quant_toggles(self._quantizer_mode)
            self._inner_model.apply(enable)
            self._fake_quant_on = True
            if self._is_rank_zero:
                log.info("fake quantization enabled at step %d", self.global_step)

    def export_model(self, epoch: int) -> None:
        """Export as usual; after the last epoch, also write the quantized model (rank 0)."""
        payload = self.export_state_dict()
        # torchtune's HF checkpointer converts payload[MODEL_KEY] to HF names in place: keep ours.
        tune_sd = dict(payload[training.MODEL_KEY]) if payload is not None else None
        self._write_export(payload, epoch)
        last = self.epochs_run >= self.total_epochs
        if last and self.options.quantize.enabled and self._is_rank_zero:
            self.quantize_and_save(tune_sd)
        torch.distributed.barrier()

    def quantized_model_config(self) -> DictConfig:
        """Model config the quantized model is built from (``quantize.model`` or the base of ``model``)."""
        return self._cfg.quantize.model if self.options.quantize.model is not None else base_model_config(self._cfg.model)

    def quantize_and_save(self, full_sd: Dict[str, torch.Tensor]) -> Path:
        """Quantize the trained weights and prove the result loads and runs.

        Args:
            full_sd (Dict[str, torch.Tensor]): exported (merged) weights on CPU.

        Returns:
            Path: the quantized checkpoint.
        """
        q = self.options.quantize
        quantizer = self._make_quantizer(self._cfg.quantize.quantizer if q.quantizer is not None else self._cfg.quantizer)
        model_cfg = self.quantized_model_config()

        def build() -> torch.nn.Module:
            with training.set_default_dtype(self._dtype), torch.device("cpu"):
                m = config.instantiate(model_cfg)
            return quantizer.prepare(m)

        model = build()
        model.load_state_dict(full_sd)
        model = quantizer.convert(model)
        qsd = model.state_dict()
        out_dir = Path(self._cfg.output_dir) / "quantized"
        out_dir.mkdir(parents=True, exist_ok=True)
        name = q.output_name or f"model-{self._quantizer_mode.replace('-qat', '')}.pt"
        path = out_dir / name
        atomic_torch_save(qsd, path)
        # Prove it: a fresh converted model loads the file (weights_only) and runs.
        check = quantizer.convert(build())
        check.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        tokens = torch.arange(8).unsqueeze(0) % 100  # (1, 8)
        with torch.no_grad():
            logits = check(tokens)
        if not torch.isfinite(logits).all():
            raise RuntimeError(f"quantized model {path} produced non-finite logits")
        buf = io.BytesIO()
        torch.save(full_sd, buf)
        log.info(
            "quantized model written to %s: %.2f MiB (unquantized export %.2f MiB), reload + forward OK",
            path, path.stat().st_size / 2**20, buf.tell() / 2**20,
        )
        return path
