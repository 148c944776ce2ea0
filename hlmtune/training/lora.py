"""What every LoRA recipe shares: adapters train, the base is frozen, exports merge them."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from omegaconf import DictConfig
from torchtune import training
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
)


class LoRAMixin:
    """Mixed into a :class:`~hlmtune.training.recipe.RecipeBase` subclass (listed first)."""

    def set_trainable(self, model: torch.nn.Module) -> None:
        """Only adapter parameters train."""
        set_trainable_params(model, get_adapter_params(model))

    def method_name(self, cfg: DictConfig) -> str:
        """``qlora`` when the base is NF4 (``quantize_base`` or a ``qlora_*`` builder)."""
        comp = str(cfg.model.get("_component_", ""))
        nf4 = bool(cfg.model.get("quantize_base", False)) or comp.rsplit(".", 1)[-1].startswith("qlora_")
        return ("q" + self.METHOD) if nf4 and self.METHOD.startswith("lora") else self.METHOD

    def check_loaded_keys(self, missing: List[str], unexpected: List[str]) -> None:
        """The base checkpoint lacks exactly the adapters; anything else is a mismatch."""
        not_adapter = [k for k in missing if "lora_" not in k and "magnitude" not in k]
        if not_adapter or unexpected:
            raise RuntimeError(
                f"base checkpoint does not match the LoRA model: missing non-adapter keys {not_adapter[:8]}, "
                f"unexpected keys {list(unexpected)[:8]}"
            )

    def export_state_dict(self) -> Optional[Dict[str, Any]]:
        """Adapters (PEFT layout) plus merged full weights, unless ``save_adapter_weights_only``."""
        adapter_only = bool(self._cfg.get("save_adapter_weights_only", False))
        sd = training.gather_cpu_state_dict(
            self._inner_model, self._is_rank_zero, device=self._device, adapter_weights_only=adapter_only
        )
        if not self._is_rank_zero:
            return None
        m = self._cfg.model
        out: Dict[str, Any] = {}
        if adapter_only:
            out[training.ADAPTER_KEY] = sd
        else:
            out[training.ADAPTER_KEY] = get_adapter_state_dict(sd)
            out[training.MODEL_KEY] = get_merged_lora_ckpt(sd, rank=m.lora_rank, alpha=m.lora_alpha)
        out[training.ADAPTER_CONFIG] = {
            "r": m.lora_rank,
            "lora_alpha": m.lora_alpha,
            "target_modules": get_lora_module_names(
                list(m.lora_attn_modules), m.get("apply_lora_to_mlp", False), m.get("apply_lora_to_output", False)
            ),
            "peft_type": "LORA",
        }
        return out
