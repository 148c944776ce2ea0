"""DPO step with the shared-prompt layout vs two rows per pair, side by side in one process.

The pack's DPO recipes compute each preference pair as one row, prompt + chosen + rejected
(the rejected completion masked from the chosen one, its positions continued from the prompt:
``hlmtune.training.dpo.shared_prompt_batch``), so the prompt runs once per pair instead of
twice, in the policy and the reference forward alike. This measures one LoRA DPO step
(policy forward with gradients, reference forward with the adapters disabled, DPO loss,
backward, AdamW) both ways on the same batch, in adjacent pairs with alternating order, over
process CPU time (one thread by default: steady under other load) and wall time, checks the
two give the same log-probabilities, and says whether the recipes' rule (the layout's tokens
at most ``SHARED_MAX_SHARE`` of the two rows') takes the layout for that batch; exit status 1
when the layout is slower where the rule takes it. Shapes:

* ``text``: a tiny Llama3 as ``benchmarks/peer_throughput.py --recipe dpo`` (4 layers x 256,
  vocab 768, LoRA r8 on q/v), 4 pairs of 256-token rows with a 64-token prompt, as that
  benchmark's rows;
* ``ecg``: the model section of ``configs/ecg_dpo.yaml`` (HLM-1M, its LoRA adapters; the
  vocabulary of the default tokenizer, 384), 16 pairs of a 213-token classification prompt +
  the class token + EOS, as the ECG DPO builder writes.

    .venv/bin/python benchmarks/dpo_shared_prompt.py [--shape text|ecg|both] [--pairs 12]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _model(shape: str):
    import torch
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from hlmtune.training.fastpath import use_addmm_lora, use_complex_rope, use_gqa_attention

    torch.manual_seed(0)
    if shape == "text":
        m = lora_llama3(lora_attn_modules=["q_proj", "v_proj"], vocab_size=768, num_layers=4, num_heads=4,
                        num_kv_heads=2, embed_dim=256, max_seq_len=512, intermediate_dim=768, lora_rank=8,
                        lora_alpha=16)
    else:  # the shipped ECG DPO model: its config's builder and adapters, no manifest needed
        from omegaconf import OmegaConf
        from torchtune import config

        cfg = OmegaConf.load(ROOT / "configs" / "ecg_dpo.yaml").model
        cfg.pop("manifest_path")
        cfg.vocab_size = 384  # the default tokenizer's 303 tokens, padded (hlmtune/hlm/model.py)
        m = config.instantiate(cfg)
    set_trainable_params(m, get_adapter_params(m))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_b" in n:
                p.normal_(std=0.02)  # policy != reference, as after some steps
    use_gqa_attention(m)  # the recipe's fast paths (hlmtune/training/recipe.py)
    use_addmm_lora(m)
    use_complex_rope(m)
    return m


def _batch(shape: str, text_prompt: int = 64):
    """(2B, T) chosen rows then rejected rows; prompt and padding labelled -100."""
    import torch

    g = torch.Generator().manual_seed(1)
    if shape == "text":
        b, t, prompt, vocab = 4, 256, text_prompt, 768
        chosen = torch.randint(1, vocab, (b, t), generator=g)
        rejected = torch.cat([chosen[:, :prompt], torch.randint(1, vocab, (b, t - prompt), generator=g)], 1)
        ids = torch.cat([chosen, rejected])
        labels = ids.clone()
        labels[:, :prompt] = -100
        return ids, labels
    b, prompt, vocab = 16, 213, 384
    p = torch.randint(10, vocab, (b, prompt), generator=g)
    good, bad = torch.randint(4, 8, (b, 1), generator=g), torch.randint(4, 8, (b, 1), generator=g)
    eos = torch.full((b, 1), 2)
    ids = torch.cat([torch.cat([p, good, eos], 1), torch.cat([p, bad, eos], 1)])
    labels = torch.full_like(ids, -100)
    labels[:b, prompt], labels[b:, prompt] = good[:, 0], bad[:, 0]
    return ids, labels


def _recipe(model):
    import torch
    from torchtune.modules.peft import disable_adapter
    from torchtune.rlhf.loss import DPOLoss

    from hlmtune.training.dpo import DPORecipe

    class Bench(DPORecipe):
        def reference_log_probs(self, input_ids, labels):
            with disable_adapter(self._inner_model):
                c, r, _ = self.concatenated_forward(self._model, input_ids, labels)
            return c, r

    r = Bench.__new__(Bench)  # only the state train_step reads
    r._model = r._inner_model = model
    r._activations_ctx = contextlib.nullcontext()
    r._loss_fn = DPOLoss(beta=0.1)
    r._gradient_accumulation_steps = 1
    r._tokenizer = None
    r.mark = lambda name: contextlib.nullcontext()
    r._opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return r


def _step(recipe, batch, shared: bool):
    from hlmtune.training import dpo

    dpo.SHARED_PROMPT = shared
    c0, w0 = time.process_time(), time.perf_counter()
    out = recipe.train_step(batch)
    recipe._opt.step()
    recipe._opt.zero_grad(set_to_none=True)
    return time.process_time() - c0, time.perf_counter() - w0, float(out["loss_sum"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("text", "ecg", "both"), default="both",
                    help="text: a tiny Llama3, 256-token rows; ecg: HLM-1M, ECG DPO prompts; both (default)")
    ap.add_argument("--pairs", type=int, default=12, help="measured (shared, two-row) step pairs (default 12)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps of each kind first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--text-prompt", type=int, default=64, help="text shape: prompt tokens of the 256 (default 64)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from hlmtune.training import dpo

    worst = float("inf")
    for shape in (("text", "ecg") if args.shape == "both" else (args.shape,)):
        model, batch = _model(shape), _batch(shape, args.text_prompt)
        recipe = _recipe(model)
        default_rule = dpo.SHARED_MAX_SHARE
        taken = dpo.shared_prompt_batch(*batch) is not None
        lay = dpo.shared_prompt_batch(*batch, max_share=1.0)
        share = lay.tokens.numel() / batch[0].numel()
        dpo.SHARED_MAX_SHARE = 1.0  # measure the layout even where the recipes' rule would not take it
        # Same loss both ways on the same weights (AdamW steps change them, so compare first).
        dpo.SHARED_PROMPT = True
        with torch.no_grad():
            a = recipe.concatenated_forward(model, *batch)
        dpo.SHARED_PROMPT = False
        with torch.no_grad():
            b = recipe.concatenated_forward(model, *batch)
        diff = max(float((a[0] - b[0]).abs().max()), float((a[1] - b[1]).abs().max()))
        for _ in range(args.warmup):
            _step(recipe, batch, True)
            _step(recipe, batch, False)
        cpu = {True: [], False: []}
        wall = {True: [], False: []}
        ratios = []
        for k in range(args.pairs):
            order = (True, False) if k % 2 == 0 else (False, True)
            got = {}
            for shared in order:
                c, w, _ = _step(recipe, batch, shared)
                cpu[shared].append(c)
                wall[shared].append(w)
                got[shared] = c
            ratios.append(got[False] / got[True])
        dpo.SHARED_PROMPT, dpo.SHARED_MAX_SHARE = True, default_rule
        two_b, t = batch[0].shape
        print(f"{shape}: {two_b // 2} pairs x {t} tokens per row, {args.threads} thread(s), {args.pairs} step pairs")
        print(f"  layout tokens / two-row tokens: {share:.3f}; the recipes take the layout at <= {default_rule}: "
              f"{'yes' if taken else 'no (two rows)'}")
        print(f"  log-probs, shared vs two rows: max |diff| {diff:.2e}")
        print(f"  median step CPU s: shared {statistics.median(cpu[True]):.4f}, two rows {statistics.median(cpu[False]):.4f}")
        print(f"  median step wall s: shared {statistics.median(wall[True]):.4f}, two rows {statistics.median(wall[False]):.4f}")
        r = statistics.median(ratios)
        print(f"  speedup of the shared layout (median over pairs of CPU-time ratios): {r:.3f}x")
        if taken:
            worst = min(worst, r)
    return 0 if worst >= 1.0 else 1  # the layout must pay wherever the recipes take it


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
