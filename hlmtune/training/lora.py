"""What every LoRA recipe shares: adapters train, the base is frozen, exports merge them."""

from __future__ import annotations

import math
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
        """The spec's ``nf4_method`` (``qlora``) when the base is NF4 (``quantize_base`` or a ``qlora_*`` builder)."""
        return self.SPEC.method_label(str(cfg.model.get("_component_", "")), bool(cfg.model.get("quantize_base", False)))

    def extra_init_state_dict(self, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """Adapter initial values drawn from the config seed, in module order.

        As torchtune's ``LoRALinear.initialize_parameters`` (Kaiming-uniform A with a=sqrt(5),
        zero B, after microsoft/LoRA), but full-size on CPU from one seeded generator: the same
        adapters whether the model is sharded (FSDP2 would otherwise draw per-shard values
        from each rank's seed + rank stream) or not.
        """
        gen = torch.Generator().manual_seed(int(self._cfg.seed))
        sd: Dict[str, torch.Tensor] = {}
        for name, m in model.named_modules():
            a, b = getattr(m, "lora_a", None), getattr(m, "lora_b", None)
            if not (isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear)):
                continue
            # State-dict names: a checkpoint-wrapped layer's hooks add the wrapper prefix back on load.
            name = name.replace("_checkpoint_wrapped_module.", "")
            wa = torch.empty(a.weight.shape, dtype=torch.float32)  # (rank, in_dim)
            torch.nn.init.kaiming_uniform_(wa, a=math.sqrt(5), generator=gen)
            sd[f"{name}.lora_a.weight"] = wa.to(self._dtype)
            sd[f"{name}.lora_b.weight"] = torch.zeros(b.weight.shape, dtype=self._dtype)  # (out_dim, rank)
        return sd

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
