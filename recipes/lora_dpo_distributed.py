"""DPO with LoRA adapters on 1..N ranks; the reference model is the base with adapters disabled.

Same name and config keys as torchtune's ``lora_dpo_distributed`` plus the pack keys; the
logged loss is the mean over ranks (torchtune logs the sum).

    hlmtune run --nproc_per_node 2 lora_dpo_distributed --config llama3_8b_lora_dpo_stack_exchange
"""

import sys

import torch
from omegaconf import DictConfig
from torchtune import config
from torchtune.modules.peft import disable_adapter

from hlmtune.training.dpo import DPORecipe
from hlmtune.training.lora import LoRAMixin
from hlmtune.training.spec import RecipeSpec


class LoRADPORecipeDistributed(LoRAMixin, DPORecipe):
    """DPO where policy = base + adapters, reference = base alone (no second model in memory)."""

    SPEC = RecipeSpec(
        name="lora_dpo_distributed",
        method="lora_dpo",
        mirrors="lora_dpo_distributed",
        summary="DPO with LoRA adapters; the frozen base is the reference model",
        requires=("checkpointer",),
        nf4_method="qlora_dpo",
    )

    def reference_log_probs(self, input_ids: torch.Tensor, labels: torch.Tensor):
        with disable_adapter(self._inner_model):
            chosen, rejected, _ = self.concatenated_forward(self._model, input_ids, labels)
        return chosen, rejected


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    config.log_config(recipe_name="LoRADPORecipeDistributed", cfg=cfg)
    recipe = LoRADPORecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
