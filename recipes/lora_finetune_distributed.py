"""LoRA and QLoRA fine-tuning on 1..N ranks (CPU with gloo, CUDA with NCCL and FSDP2).

Same name and config keys as torchtune's ``lora_finetune_distributed``, plus the pack keys
(``data_loader``, ``data_parallel``, ``save_every_n_steps``). QLoRA is this recipe with an NF4
base (``quantize_base: True`` or a ``qlora_*`` model builder).

    hlmtune run --nproc_per_node 2 lora_finetune_distributed --config llama3_8b_lora_alpaca
"""

import sys

from omegaconf import DictConfig
from torchtune import config

from hlmtune.training.lora import LoRAMixin
from hlmtune.training.recipe import SFTRecipe
from hlmtune.training.spec import RecipeSpec


class LoRAFinetuneRecipeDistributed(LoRAMixin, SFTRecipe):
    """LoRA fine-tuning: adapters train, base weights frozen (optionally NF4)."""

    SPEC = RecipeSpec(
        name="lora_finetune_distributed",
        method="lora",
        mirrors="lora_finetune_distributed",
        summary="LoRA and QLoRA (NF4 base) fine-tuning",
        requires=("checkpointer",),
        nf4_method="qlora",
    )


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    config.log_config(recipe_name="LoRAFinetuneRecipeDistributed", cfg=cfg)
    recipe = LoRAFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
