"""Tiny Llama3 assets: a valid tiktoken BPE, special tokens after it, a loadable HF checkpoint."""

from __future__ import annotations

import json

from hlmtune.tiny import train_bpe_ranks, write_tiny_assets


def test_bpe_merges_are_built_from_lower_ranks():
    ranks = train_bpe_ranks("the cat sat on the mat, the cat sat", 8)
    assert len(ranks) == 256 + 8
    assert len(train_bpe_ranks("ab ab", 50)) < 256 + 50  # stops when no pair is left
    for tok, rank in ranks.items():
        if len(tok) > 1:  # tiktoken needs every merged token to split into two lower-ranked ones
            assert any(tok[:i] in ranks and tok[i:] in ranks and max(ranks[tok[:i]], ranks[tok[i:]]) < rank
                       for i in range(1, len(tok)))
    assert train_bpe_ranks("the cat sat on the mat", 20) == train_bpe_ranks("the cat sat on the mat", 20)


def test_assets_round_trip_through_torchtune(tmp_path):
    from torchtune.models.llama3 import llama3_tokenizer
    from torchtune.training import FullModelHFCheckpointer

    a = write_tiny_assets(tmp_path / "m")
    tok = llama3_tokenizer(a["tokenizer_path"], special_tokens_path=a["special_tokens_path"])
    text = "Summarize this dialogue: the heart beats 72 times a minute."
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < a["vocab_size"]
    assert tok.decode(ids[1:-1]) == text
    assert len(ids) < len(text)  # merges compress
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["vocab_size"] == a["vocab_size"] == 768
    ck = FullModelHFCheckpointer(checkpoint_dir=str(tmp_path / "m"), checkpoint_files=["model.safetensors"],
                                 model_type="LLAMA3", output_dir=str(tmp_path / "out"))
    sd = ck.load_checkpoint()["model"]
    assert sd["layers.0.attn.q_proj.weight"].shape == (256, 256)
    assert sd["layers.0.attn.k_proj.weight"].numel() % 16384 == 0  # NF4-compatible
