"""QAT with LoRA adapters on 1..N ranks, ending in a quantized merged model.

Same name and config keys as torchtune's ``qat_lora_finetune_distributed`` plus the pack keys
and ``quantize``. LoRA linears get fake-quantized activations and base weights; after the last
epoch the merged weights are quantized (int8 dynamic activations, int4 weights) into
``<output_dir>/quantized/``.

    hlmtune run --nproc_per_node 4 qat_lora_finetune_distributed --config llama3_8b_qat_lora_alpaca
"""

import sys

import torch
from omegaconf import DictConfig
from torchtune import config
from torchtune.training.quantization import swap_lora_linear_with_qat

from hlmtune.training.lora import LoRAMixin
from hlmtune.training.qat import QATMixin
from hlmtune.training.recipe import SFTRecipe
from hlmtune.training.spec import RecipeSpec


class QATLoRAFinetuneRecipeDistributed(QATMixin, LoRAMixin, SFTRecipe):
    """LoRA adapters train on top of a frozen, fake-quantized base."""

    SPEC = RecipeSpec(
        name="qat_lora_finetune_distributed",
        method="qat_lora",
        mirrors="qat_lora_finetune_distributed",
        summary="QAT with LoRA adapters, then quantization of the merged model",
        adds=("quantize",),
        requires=("checkpointer", "quantizer"),
    )

    def prepare_model(self, model: torch.nn.Module, cfg: DictConfig) -> torch.nn.Module:
        quantizer = self._make_quantizer(cfg.quantizer)
        swap_lora_linear_with_qat(
            model, quantizer.get_activation_fake_quantize_config(), quantizer.get_weight_fake_quantize_config()
        )
        self._maybe_delay_fake_quant(model)
        return model


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    config.log_config(recipe_name="QATLoRAFinetuneRecipeDistributed", cfg=cfg)
    recipe = QATLoRAFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
