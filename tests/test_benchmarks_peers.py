"""Row files shared by the peer benchmark: layout, checks, torchtune item format, RSS measure."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # peers.py: not installed
from peers import (  # noqa: E402
    IGNORE_INDEX,
    TokenRows,
    dpo_rows_from_sft,
    peak_rss_gib_of,
    read_rows,
    synthetic_sft_rows,
    token_rows_dataset,
    write_rows,
)

ROOT = Path(__file__).resolve().parent.parent


def test_sft_rows_round_trip_in_torchtune_item_layout(tmp_path):
    rows = synthetic_sft_rows(5, 8, vocab_size=50, seed=3)
    rows["labels"][:, :3] = IGNORE_INDEX  # a prompt
    path = write_rows(tmp_path / "r.npz", rows)
    back = read_rows(path)
    np.testing.assert_array_equal(back["tokens"], rows["tokens"])
    ds = token_rows_dataset(None, str(path))
    assert len(ds) == 5 and not ds.is_dpo
    item = ds[2]
    assert item == {"tokens": rows["tokens"][2].tolist(), "labels": rows["labels"][2].tolist()}
    assert item["labels"][:3] == [IGNORE_INDEX] * 3
    # torchtune's SFT collate takes the items as they are: no padding for fixed-length rows.
    from torchtune.data import padded_collate_sft

    batch = padded_collate_sft([ds[0], ds[1]])
    assert batch["tokens"].shape == (2, 8)


def test_synthetic_rows_are_seeded():
    a, b = synthetic_sft_rows(3, 6, 40, seed=1), synthetic_sft_rows(3, 6, 40, seed=1)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert a["tokens"].max() < 40 and (a["labels"] == a["tokens"]).all()


def test_dpo_rows_share_the_prompt_and_mask_it(tmp_path):
    sft = {"tokens": np.arange(4 * 6).reshape(4, 6), "labels": np.arange(4 * 6).reshape(4, 6)}
    d = dpo_rows_from_sft(sft, prompt_len=2)
    assert d["chosen_tokens"].shape == (3, 6)
    np.testing.assert_array_equal(d["chosen_tokens"][:, :2], d["rejected_tokens"][:, :2])
    np.testing.assert_array_equal(d["rejected_tokens"][0, 2:], sft["tokens"][1, 2:])  # next row's completion
    assert (d["chosen_labels"][:, :2] == IGNORE_INDEX).all() and (d["rejected_labels"][:, 2:] >= 0).all()
    ds = TokenRows(write_rows(tmp_path / "d.npz", d))
    assert ds.is_dpo and set(ds[0]) == {"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"}
    from torchtune.data import padded_collate_dpo

    ids, labels = padded_collate_dpo([ds[0], ds[1]])
    assert ids.shape == (4, 6) and labels.shape == (4, 6)
    with pytest.raises(ValueError, match="prompt_len"):
        dpo_rows_from_sft(sft, prompt_len=6)


def test_bad_row_files_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="must be"):
        write_rows(tmp_path / "x.npz", {"tokens": np.zeros((2, 3))})
    with pytest.raises(ValueError, match=r"share one \(N, T\) shape"):
        write_rows(tmp_path / "x.npz", {"tokens": np.zeros((2, 3)), "labels": np.zeros((2, 4))})
    assert not (tmp_path / "x.npz").exists()  # nothing half-written
    other = tmp_path / "other.npz"
    np.savez(other, foo=np.zeros(3))
    with pytest.raises(ValueError, match=f"{other}: not a row file"):
        read_rows(other)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        read_rows(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="packed=True"):
        token_rows_dataset(None, str(other), packed=True)


def test_peak_rss_of_a_child_sees_its_allocation(tmp_path):
    code = "import numpy as np; a = np.ones(300 * 2**20 // 8); print(a.sum())"
    big = peak_rss_gib_of([sys.executable, "-c", code], dict(os.environ), log_path=tmp_path / "log")
    small = peak_rss_gib_of([sys.executable, "-c", "pass"], dict(os.environ))
    assert big["returncode"] == 0 and small["returncode"] == 0
    assert big["peak_rss_gib"] - small["peak_rss_gib"] > 0.25  # the 300 MiB array
    # Not floored at the caller's size (this test process holds torch: several hundred MiB).
    assert small["peak_rss_gib"] < 0.15
    assert "39321600" in (tmp_path / "log").read_text()
    failing = peak_rss_gib_of([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ))
    assert failing["returncode"] == 3
    missing = peak_rss_gib_of([str(tmp_path / "no-such-program")], dict(os.environ))
    assert missing["returncode"] != 0


def test_shipped_knobs_read_the_speed_settings_of_a_config(tmp_path):
    from peers import SHIPPED_CONFIGS, shipped_knobs, torchtune_config_file

    cfg = tmp_path / "c.yaml"
    cfg.write_text("enable_activation_checkpointing: True\nenable_activation_offloading: True\n"
                   "compile: False\noptimizer:\n  _component_: torch.optim.AdamW\n  fused: True\nbatch_size: 2\n")
    assert shipped_knobs(cfg) == {"enable_activation_checkpointing": True, "compile": False, "optimizer.fused": True}
    assert shipped_knobs(cfg, device="cuda")["enable_activation_offloading"] is True  # CUDA-only knob kept there
    for pack_cfg, tt_cfg in SHIPPED_CONFIGS.values():
        assert shipped_knobs(ROOT / "configs" / pack_cfg)["enable_activation_checkpointing"] == "auto"
        # torchtune 0.6.1's single-device 8B configs checkpoint every layer.
        assert shipped_knobs(torchtune_config_file(tt_cfg))["enable_activation_checkpointing"] is True
    with pytest.raises(FileNotFoundError, match="llama3/8B_nope"):
        torchtune_config_file("llama3/8B_nope")
