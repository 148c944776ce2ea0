"""Faster training paths inside the pack's model code, each numerically equivalent to torchtune's.

Measured with ``benchmarks/peer_throughput.py`` (README "Speed vs peers"); each path is kept
only where it pays, and each has a test comparing loss and gradients against torchtune's
unmodified modules (tests/test_training_fastpath.py).

* :func:`use_gqa_attention`: torchtune 0.6.1's ``MultiHeadAttention`` copies K and V to
  every query head (``expand(...).flatten``, a materialised copy) before SDPA; SDPA's
  ``enable_gqa=True`` (torch >= 2.5) reads the shared K/V heads directly. Training path only
  (no KV cache, no flex-attention block mask); every other call runs torchtune's forward.
  On CUDA only with fp16/bf16: there the flash kernel takes GQA, while fp32 would fall from
  the memory-efficient kernel (no GQA support) to the math kernel, so fp32 CUDA keeps
  torchtune's expansion (:func:`gqa_pays`).
* :func:`target_positions_only`: the output projection and cross-entropy only at positions
  that have a label. torchtune projects every position to the vocabulary (in chunks) and
  then ignores the masked ones; prompts, padding and, in the ECG classification configs,
  all but one position per example carry no label.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F


def _gqa_forward(self: Any, x: torch.Tensor, y: Optional[torch.Tensor] = None, *, mask: Any = None,
                 input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``MultiHeadAttention.forward`` without the K/V head expansion (same math).

    Args:
        x (torch.Tensor): (b, s_x, d) queries' input.
        y (Optional[torch.Tensor]): (b, s_y, d) keys'/values' input.
        mask (Any): None (causal), or a boolean (b, s_x, s_y) tensor, True = attend.
        input_pos (Optional[torch.Tensor]): (b, s) positions (packed sequences).

    Returns:
        torch.Tensor: (b, s_x, d).
    """
    if y is None or self.kv_cache is not None or not (mask is None or isinstance(mask, torch.Tensor)):
        return self._torchtune_forward(x, y, mask=mask, input_pos=input_pos)
    b, s_x, _ = x.shape
    s_y = y.shape[1]
    q = self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim)  # (b, s_x, n_h, h_d)
    k = self.k_proj(y).view(b, s_y, -1, self.head_dim)  # (b, s_y, n_kv, h_d)
    v = self.v_proj(y).view(b, s_y, -1, self.head_dim)
    if self.pos_embeddings is not None:
        q = self.pos_embeddings(q, input_pos=input_pos)
        k = self.pos_embeddings(k, input_pos=input_pos)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, s, h_d)
    if self.q_norm is not None:
        q = self.q_norm(q)
    if self.k_norm is not None:
        k = self.k_norm(k)
    if mask is not None and mask.dim() == 3:
        mask = mask[:, None, :, :]  # (b, 1, s_x, s_y): broadcast over heads, as torchtune does
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=self.attn_dropout if self.training else 0.0,
        is_causal=mask is None and self.is_causal, enable_gqa=True,
    )  # (b, n_h, s_x, h_d)
    return self.output_proj(out.transpose(1, 2).contiguous().view(b, s_x, -1))


def gqa_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether SDPA's ``enable_gqa`` is the faster path on this device and dtype.

    CPU: always (the flash CPU kernel and the math kernel both read shared K/V heads).
    CUDA: fp16/bf16 only (flash attention); fp32 has no flash kernel, and the memory-efficient
    kernel it would otherwise use does not take ``enable_gqa``. Other devices: no.
    """
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def use_gqa_attention(model: torch.nn.Module) -> int:
    """Route every torchtune ``MultiHeadAttention`` of ``model`` through :func:`_gqa_forward`.

    Modules without grouped K/V heads (``num_kv_heads == num_heads``) keep torchtune's
    forward: there is nothing to expand.

    Args:
        model (torch.nn.Module): a torchtune model (unwrapped, before compile or wrapping).

    Returns:
        int: the number of attention modules changed (0: nothing to do, e.g. no GQA model).
    """
    from torchtune.modules import MultiHeadAttention

    n = 0
    for m in model.modules():
        if isinstance(m, MultiHeadAttention) and m.num_heads != m.num_kv_heads and not hasattr(m, "_torchtune_forward"):
            m._torchtune_forward = m.forward
            m.forward = types.MethodType(_gqa_forward, m)
            n += 1
    return n


def target_logits_applies(model: torch.nn.Module, loss_fn: Any) -> bool:
    """Whether :func:`target_positions_only` gives the loss ``loss_fn`` would.

    True for a torchtune ``TransformerDecoder`` (no intermediate hidden-state outputs) with
    a token-mean cross-entropy: torchtune's ``CEWithChunkedOutputLoss``, or a plain
    ``torch.nn.CrossEntropyLoss`` (mean, no class weights, no label smoothing).

    Args:
        model (torch.nn.Module): the unwrapped model.
        loss_fn (Any): the recipe's loss.
    """
    from torchtune.modules import TransformerDecoder
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    if not isinstance(model, TransformerDecoder) or model.output_hidden_states:
        return False
    if isinstance(loss_fn, CEWithChunkedOutputLoss):
        return True
    return (type(loss_fn) is torch.nn.CrossEntropyLoss and loss_fn.reduction == "mean"
            and loss_fn.weight is None and loss_fn.label_smoothing == 0.0)


@contextlib.contextmanager
def target_positions_only(model: torch.nn.Module, keep: torch.Tensor) -> Iterator[None]:
    """Within the block, ``model(...)`` returns fp32 logits of the kept positions only.

    The final norm and the output projection run inside the model's forward (so DDP and
    FSDP see every parameter used there), on ``h[keep]`` instead of every position; the
    norm is per position, so selecting first changes nothing but the work.

    Args:
        model (torch.nn.Module): a torchtune ``TransformerDecoder`` (unwrapped; the call may
            go through a wrapper).
        keep (torch.Tensor): (B, T) bool, True where the shifted label is a target.

    Yields:
        None: inside, the forward returns (N, V) logits, N = ``keep.sum()``, in row-major
        order of ``keep`` (the order of ``labels[keep]``).
    """
    own = model.__dict__.get("unembed")

    def unembed(h: torch.Tensor) -> torch.Tensor:  # h: (B, T, D)
        return model.output(model.norm(h[keep])).float()  # (N, V)

    model.unembed = unembed
    try:
        yield
    finally:
        if own is None:
            del model.unembed
        else:
            model.unembed = own
