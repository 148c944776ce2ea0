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
* :func:`use_blocked_causal_attention` (CPU, eager): PyTorch's CPU flash kernel computes the
  whole score matrix of a causal call up to 512 keys; attending in blocks of 128 query rows,
  each over the keys it can see, skips most of the hidden half (fwd+bwd 1.15-1.42x at the
  benchmarks' shapes, :data:`CAUSAL_BLOCK`).
* :func:`use_onednn_linear` (CPU, fp32, eager, where :func:`onednn_linear_decision` at the model's
  layer shapes says so): MKL, which ``torch.mm`` calls for fp32 on CPU, picks its kernels by CPU
  vendor and on some AMD hosts runs at less than half of oneDNN's speed (on others 0.8-0.95 of
  it); the model's linear layers call oneDNN's GEMM directly
  (forward, input and weight gradients), the same fp32 products in another summation order.
* :func:`use_addmm_lora`: torchtune's ``LoRALinear`` scales the adapter's full-width output
  (``alpha / rank * lora_b(...)``, one multiply over (tokens, out_dim)) and then adds it to the
  base output (another pass), and backward repeats the multiply. One ``addmm`` does
  ``out += scale * a @ B^T`` in the GEMM itself, in place (beta = 1 accumulates into the base
  output, which no backward needs); in backward the scale lands on the rank-r products only.
* :func:`use_complex_rope`: torchtune's RoPE rotates each (even, odd) pair with four
  multiplies, two adds and a ``stack`` over selected halves, whose backward fills zeros and
  copies per half; the same rotation is one complex multiply (the cache's last dim is
  (cos, sin)), with a one-multiply backward: fwd+bwd 0.9 vs 8.4 ms at the ECG model's
  (32, 213, 4, 32).
* :func:`target_positions_only`: the output projection and cross-entropy only at positions
  that have a label. torchtune projects every position to the vocabulary (in chunks) and
  then ignores the masked ones; prompts, padding and, in the ECG classification configs,
  all but one position per example carry no label. Inside the same block the last
  transformer layer runs its queries, attention output, MLP and residuals only at those
  positions too (:func:`_last_layer_at_targets`): with a causal model nothing else of that
  layer reaches the loss; its keys and values still cover every position. Skipped, leaving
  torchtune's layer, where the layer is activation-checkpointed (the recompute would run
  after the block) or compiled, or is not a plain self-attention layer.
  With ``chunked=True`` (CPU) the output projection runs in the row chunks of
  :func:`chunked_cross_entropy`, so neither the (N, V) logits nor their gradient is built.
* :func:`query_logits` (``hlmtune eval``, eager or compiled): a decoder's logits at chosen
  positions only, its last layer as in :func:`target_positions_only`, as one plain function of
  tensors that ``torch.compile`` traces once for fixed shapes.
* :func:`inference_fastpath` (``hlmtune eval``; no autograd): the complex RoPE above and the
  SwiGLU feed-forward with SiLU and the gate product in place (:func:`_swiglu_inference_forward`),
  two fewer (tokens, hidden) tensors per layer to allocate and fill.
"""

from __future__ import annotations

import contextlib
import functools
import types
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

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
    dropout = self.attn_dropout if self.training else 0.0
    gqa = self.num_heads != self.num_kv_heads
    block = getattr(self, "_causal_block", 0)
    if mask is None and self.is_causal and block and dropout == 0.0:
        out = causal_sdpa_blocked(q, k, v, block=block, enable_gqa=gqa)  # (b, n_h, s_x, h_d)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None and self.is_causal, enable_gqa=gqa,
        )  # (b, n_h, s_x, h_d)
    return self.output_proj(out.transpose(1, 2).contiguous().view(b, s_x, -1))


# Query rows per block of :func:`causal_sdpa_blocked`. Measured 2026-11-26 (SDPA fwd+bwd, one
# thread, CPU time; blocks of 64 / 128 / 256 against one causal call): (4, 4 heads / 2 kv, 512,
# 128) 1.42x / 1.42x / 1.24x; (8, 4 / 4, 512, 32) 1.27x / 1.37x / 1.27x; (4, 4 / 2, 256, 64)
# 1.18x / 1.15x; (2, 4 / 2, 1024, 128) 1.08x / 1.15x / 1.12x.
CAUSAL_BLOCK = 128


@functools.lru_cache(maxsize=64)
def _lower_right_causal(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """(rows, cols) bool mask, True = attend: query row r is position cols - rows + r."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril(diagonal=cols - rows)


def causal_sdpa_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block: int = CAUSAL_BLOCK,
                        enable_gqa: bool = False) -> torch.Tensor:
    """Causal self-attention in blocks of query rows, each over the keys it can see (same math).

    PyTorch's CPU flash-attention kernel splits the keys in blocks of up to 512 and skips a
    block only when the causal mask hides all of it, so at 512 tokens or fewer a causal call
    costs what a full one does (measured: 88 vs 86 ms fwd+bwd at (4, 8, 512, 64)). Query rows
    [a, a + block) see keys [0, a + block) only: one SDPA call per block over those keys,
    with the causal corner as a mask, does 1/2 + 1/(2n) of the work for n blocks. Every row's
    softmax runs over the same keys as in one causal call, so outputs match to rounding.

    Args:
        q (torch.Tensor): (b, n_h, s, h_d).
        k (torch.Tensor): (b, n_kv, s, h_d).
        v (torch.Tensor): (b, n_kv, s, h_d).
        block (int): query rows per call; fewer than two blocks of rows: one causal call.
        enable_gqa (bool): ``n_kv < n_h`` (SDPA reads the grouped heads).

    Returns:
        torch.Tensor: (b, n_h, s, h_d).
    """
    s = q.shape[2]
    if block <= 0 or s < 2 * block or k.shape[2] != s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    outs = [F.scaled_dot_product_attention(q[:, :, :block], k[:, :, :block], v[:, :, :block], is_causal=True,
                                           enable_gqa=enable_gqa)]  # the first block: square, causal
    for a in range(block, s, block):
        e = min(s, a + block)
        outs.append(F.scaled_dot_product_attention(
            q[:, :, a:e], k[:, :, :e], v[:, :, :e], attn_mask=_lower_right_causal(e - a, e, q.device),
            enable_gqa=enable_gqa))  # (b, n_h, e - a, h_d)
    return torch.cat(outs, dim=2)


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
        if isinstance(m, MultiHeadAttention) and m.num_heads != m.num_kv_heads and _route_attention(m):
            n += 1
    return n


def _route_attention(m: Any) -> bool:
    """Send a ``MultiHeadAttention``'s calls through :func:`_gqa_forward` (once); True if it changed now."""
    if hasattr(m, "_torchtune_forward"):
        return False
    m._torchtune_forward = m.forward
    m.forward = types.MethodType(_gqa_forward, m)
    return True


def _mkldnn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(N, in) x (out, in) -> (N, out) = x @ weight^T (+ bias) in oneDNN's fp32 GEMM.

    ``weight`` may be a strided view (the backward passes transposes without copying them).
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """``F.linear`` on 2-D input with oneDNN's GEMMs forward and backward (same fp32 math)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        # x: (N, in), weight: (out, in). The input is kept only when the weight trains (as
        # autograd's own mm does): a frozen base layer's backward needs the weight alone.
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        return _mkldnn_linear(x, weight, bias)  # (N, out)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:  # dy: (N, out)
        x, weight = ctx.saved_tensors
        dx = _mkldnn_linear(dy, weight.t(), None) if ctx.needs_input_grad[0] else None  # (N, in) = dy @ W
        dw = _mkldnn_linear(dy.t(), x.t(), None) if ctx.needs_input_grad[1] else None  # (out, in) = dy^T @ x
        db = dy.sum(0) if ctx.needs_input_grad[2] else None
        return dx, dw, db


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN for fp32 CPU tensors, else ``F.linear``.

    Args:
        x (torch.Tensor): (..., in).
        weight (torch.Tensor): (out, in).
        bias (Optional[torch.Tensor]): (out,).

    Returns:
        torch.Tensor: (..., out).
    """
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or not weight.is_cpu:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    out = _OneDnnLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)  # (N, out)
    return out.view(*lead, out.shape[-1])


PROBE_TRIALS = 5  # best of 5 interleaved timings each: one preempted timing does not decide


def probe_cache_path(name: str = "onednn_linear") -> Path:
    """Where a host keeps a probe's decisions (``$HLM_CACHE_DIR``, default ``~/.cache/hlmtune``, ``<name>.json``)."""
    import os

    root = os.environ.get("HLM_CACHE_DIR", "").strip()
    return (Path(root) if root else Path.home() / ".cache" / "hlmtune") / f"{name}.json"


def cpu_model_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``cpu`` where there is none): run.json, probe key."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


# The environment that holds ATen's, oneDNN's and MKL's CPU kernels to AVX2 on a host with AVX-512:
# its runs then sum as an AVX2 host's do (an AMD EPYC with AVX-512 pretrained a recorded fold to the
# bytes an AVX2 AMD EPYC had, and to other bytes without it; docs/hlm.md, plan hlm_finetune_lr).
AVX2_KERNELS_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def kernel_settings(env: Any) -> Dict[str, str]:
    """The variables of :data:`AVX2_KERNELS_ENV` that ``env`` (a mapping: ``os.environ``, a run's) sets."""
    return {k: env[k] for k in AVX2_KERNELS_ENV if k in env}


def kernel_isa() -> str:
    """The instruction set of ATen's CPU kernels in this process (``AVX512``, ``AVX2``, ``DEFAULT``...).

    ``ATEN_CPU_CAPABILITY`` caps it (:data:`AVX2_KERNELS_ENV`); two hosts whose kernels differ sum
    in other orders, so their runs differ in the last bits and then, after hundreds of steps, more.
    """
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # a torch without the query
        return "unknown"


INDUCTOR_KERNELS_PREFIX = "aten-"  # inductor_cache_for_kernels' folders: aten-avx2, aten-avx512...


def inductor_cache_for_kernels(env: Any = None) -> str:
    """Point inductor's on-disk cache at a folder of this process's ATen kernels; returns the folder.

    torch 2.13's inductor cache does not key compiled code by the kernels ``ATEN_CPU_CAPABILITY``
    selects: on an AMD EPYC with AVX-512 (2026-12-07), a graph compiled under
    ``ATEN_CPU_CAPABILITY=avx2`` (:data:`AVX2_KERNELS_ENV`) after an AVX-512 process had filled the
    cache got that process's code and computed wrong logits (the HLM's: up to 50 off, NaN at most
    of a fine-tune's queries; a 1M-parameter model: 2.1 off), and an AVX-512 process after an AVX2
    one corrupted the heap. A fresh folder gave the eager logits both ways. So every kernel set
    gets its own folder under the cache (``TORCHINDUCTOR_CACHE_DIR``'s, else torch's default):
    ``<cache>/aten-avx2``. Set in ``env`` (``os.environ`` by default, which child processes
    inherit; a child under other kernels moves to its own folder beside it). Call before
    ``torch.compile``.
    """
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = os.environ if env is None else env
    base = Path(env.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    if base.name.startswith(INDUCTOR_KERNELS_PREFIX):  # set by this function in this or a parent process
        base = base.parent
    folder = str(base / f"{INDUCTOR_KERNELS_PREFIX}{kernel_isa().lower()}")
    env["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def _probe_key() -> str:
    """What the decision depends on: the CPU model, torch (and its oneDNN), intra-op threads, and the
    kernels ATen, oneDNN and MKL may use (:data:`AVX2_KERNELS_ENV`): a timing under AVX2 kernels on an
    AVX-512 host is not one under its own."""
    import os

    held = "".join(f" {k}={v}" for k, v in sorted(kernel_settings(os.environ).items()))
    return f"{cpu_model_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {kernel_isa()}{held}"


PROBE_ROUNDS = 3  # independent rounds (each best of PROBE_TRIALS): a decision holds in every round
# oneDNN is taken when MKL's time is at least this multiple of oneDNN's in every round, timed at
# the model's own layer shapes, forward and backward (since 2026-12-02, evening: one (1024, 512)
# x (512, 512) forward product read 0.91-1.00x on a host where the model's layers, forward and
# backward, ran 1.06-1.14x faster through oneDNN at 2 threads and 1.09x at one; it needed 1.15x).
TAKE_AT = 1.05
# Kept for the host only with a margin: every round's ratio outside (KEEP_BELOW, KEEP_ABOVE).
# A ratio inside it is decided for this run alone (MKL, torch's default path) and measured again
# by the next run, so a timing under load does not fix the library for good.
KEEP_BELOW, KEEP_ABOVE = 1.0, TAKE_AT
# The probe's products: at most this many distinct layer shapes (the largest), each at the rows
# a step gives it: PROBE_ROWS rows of tokens, the output projection in the cross-entropy's row
# chunks (ce_chunk_rows: 262 rows at an 8,000-token vocabulary, where the libraries differ most:
# oneDNN 1.24x MKL forward at 2 threads, 1.04x at 2,044 rows). Rows are scaled down, to no fewer
# than 64, where one forward over all shapes would exceed PROBE_FLOP floating-point operations.
PROBE_SHAPES, PROBE_ROWS, PROBE_FLOP = 6, 1024, 8e9
# Where no model is given: a (1024, 512) x (512, 512) frozen layer (the probe of before).
DEFAULT_LINEAR_SHAPES: Tuple[Tuple[int, int, int, bool], ...] = ((1024, 512, 512, False),)


def linear_shapes(model: torch.nn.Module) -> Tuple[Tuple[int, int, int, bool], ...]:
    """(rows, in, out, weight trains) of the distinct fp32 layers :func:`use_onednn_linear` would route.

    The largest :data:`PROBE_SHAPES` by ``in x out`` (where a step's GEMM time is), largest first,
    at the rows a training step of :data:`PROBE_ROWS` tokens gives each (above).
    """
    from torchtune.modules.peft import LoRALinear

    vocab = output_vocab_size(getattr(model, "output", None))
    found = set()
    for m in model.modules():
        if (type(m) is torch.nn.Linear or (type(m) is LoRALinear and not m._quantize_base)) and \
                m.weight.dtype == torch.float32:
            out_dim, in_dim = m.weight.shape
            found.add((int(in_dim), int(out_dim), bool(m.weight.requires_grad)))
    shapes = sorted(found, key=lambda s: (-s[0] * s[1], s))[:PROBE_SHAPES]
    if not shapes:
        return DEFAULT_LINEAR_SHAPES
    rows = {s: (ce_chunk_rows(PROBE_ROWS, vocab, torch.device("cpu")) or PROBE_ROWS) if vocab and s[1] == vocab
            else PROBE_ROWS for s in shapes}
    scale = min(1.0, PROBE_FLOP / sum(2 * rows[s] * s[0] * s[1] for s in shapes))
    return tuple((max(64, int(rows[s] * scale)), *s) for s in shapes)


def _probe_onednn(shapes: Tuple[Tuple[int, int, int, bool], ...] = DEFAULT_LINEAR_SHAPES) -> Dict[str, Any]:
    """Time MKL's and oneDNN's fp32 GEMMs at the layer shapes given, :data:`PROBE_ROUNDS` rounds.

    One timing is every shape's forward and backward (input gradient, and the weight's where it
    trains), as a training step runs them: through ``F.linear`` (MKL) and :class:`_OneDnnLinear`.

    Args:
        shapes (Tuple[Tuple[int, int, int, bool], ...]): (rows, in, out, weight trains), e.g.
            from :func:`linear_shapes`.

    Returns:
        Dict[str, Any]: ``onednn`` (taken), ``clear`` (every round on one side of the margin
        band, so the answer may be kept), ``ratios`` (MKL / oneDNN time per round), ``mkl_ms``,
        ``onednn_ms`` (best over all rounds), or ``onednn`` False and ``why`` where oneDNN
        cannot be used.
    """
    import time

    g = torch.Generator().manual_seed(0)
    layers = []
    for rows, in_dim, out_dim, trains in shapes:
        x = torch.randn(rows, in_dim, generator=g).requires_grad_()  # (rows, in)
        w = (torch.randn(out_dim, in_dim, generator=g) / in_dim ** 0.5).requires_grad_(trains)  # (out, in)
        layers.append((x, w))
    try:
        for x, w in layers:
            if not torch.allclose(_mkldnn_linear(x.detach(), w.detach(), None), F.linear(x.detach(), w.detach()),
                                  rtol=1e-4, atol=1e-4):
                return {"onednn": False, "clear": True, "why": "oneDNN's product disagrees beyond fp32 rounding"}
    except RuntimeError:  # a build whose oneDNN lacks the op for this CPU
        return {"onednn": False, "clear": True, "why": "oneDNN's linear op fails on this CPU"}

    def step(linear: Any) -> Any:
        def run() -> None:
            for x, w in layers:
                linear(x, w, None).sum().backward()
                x.grad = w.grad = None
        return run

    ratios, overall = timing_rounds(step(F.linear), step(_OneDnnLinear.apply))  # best of PROBE_TRIALS
    return {"onednn": min(ratios) >= TAKE_AT, "clear": _clear(ratios), "ratios": [round(r, 3) for r in ratios],
            "mkl_ms": overall[0] * 1e3, "onednn_ms": overall[1] * 1e3}


def timing_rounds(default: Any, candidate: Any, *, rounds: int = PROBE_ROUNDS, trials: int = PROBE_TRIALS) -> Tuple[List[float], Tuple[float, float]]:
    """Time two callables interleaved: per round (best of ``trials`` each) default / candidate time.

    Returns:
        Tuple[List[float], Tuple[float, float]]: the per-round ratios (above 1: the candidate is
        faster) and the best seconds of each over all rounds.
    """
    import time

    ratios, overall = [], [float("inf"), float("inf")]
    for _ in range(rounds):
        best = [float("inf"), float("inf")]
        for _ in range(trials):
            for i, fn in enumerate((default, candidate)):
                t0 = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t0)
        ratios.append(best[0] / best[1])
        overall = [min(o, b) for o, b in zip(overall, best)]
    return ratios, (overall[0], overall[1])


def _clear(ratios: List[float]) -> bool:
    """Every round on one side of the margin band: a decision that may be kept for the host."""
    return all(r >= KEEP_ABOVE for r in ratios) or all(r <= KEEP_BELOW for r in ratios)


def kept_decision(name: str, key: str, probe: Any, describe: Any, take: str, *,
                  borderline: Optional[bool] = False) -> Tuple[bool, str]:
    """A probe's decision for this host: the kept one, else measured (and kept when clear).

    Args:
        name (str): the cache file's name (``probe_cache_path(name)``).
        key (str): what the decision depends on (CPU, torch, threads, shape).
        probe (Callable[[], Dict[str, Any]]): measures; returns ``take`` (bool), ``clear``
            (bool) and whatever ``describe`` reads.
        describe (Callable[[Dict[str, Any]], str]): the measurement in words.
        take (str): the key of the probe's answer.
        borderline (Optional[bool]): the answer when the probe is not clear (this run only); None:
            the probe's own answer.

    Returns:
        Tuple[bool, str]: (taken, why).
    """
    import datetime
    import json

    path = probe_cache_path(name)
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure (and write it anew)
        kept = {}
    if not isinstance(kept, dict):
        kept = {}
    entry = kept.get(key)
    # Kept: a decision with a margin. An entry of an earlier version (one round, no margin test)
    # is measured again.
    if isinstance(entry, dict) and isinstance(entry.get(take), bool) and entry.get("clear") is True:
        return entry[take], f"kept for this host in {path} (measured {entry.get('measured', '?')}: {describe(entry)})"
    found = probe()
    if not found["clear"]:  # borderline: this run only, nothing written
        answer = found[take] if borderline is None else borderline
        return answer, (describe(found).rsplit(":", 1)[0] + f": borderline ({found.get('band', f'{KEEP_BELOW}-{KEEP_ABOVE}')}x), "
                        f"{'taken' if answer else 'not taken'} for this run, not kept")
    kept[key] = {**found, "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        from hlmtune.files import atomic_write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(kept, indent=1) + "\n")
    except OSError:  # a read-only home: decided for this process only
        pass
    return found[take], describe(found) + f"; kept in {path}"


def _probe_why(found: Dict[str, Any]) -> str:
    if "why" in found:
        return found["why"]
    ratios = ", ".join(f"{r:.2f}" for r in found["ratios"])
    side = "oneDNN" if found["onednn"] else "MKL"
    return (f"MKL {found['mkl_ms']:.2f} ms vs oneDNN {found['onednn_ms']:.2f} ms, MKL/oneDNN {ratios} over "
            f"{len(found['ratios'])} rounds (oneDNN from {TAKE_AT}x in every round): {side}")


def onednn_linear_pays(shapes: Tuple[Tuple[int, int, int, bool], ...] = DEFAULT_LINEAR_SHAPES) -> bool:
    """Whether oneDNN's fp32 GEMM is taken on this host and thread count (see :func:`onednn_linear_decision`)."""
    return onednn_linear_decision(shapes)[0]


def _shapes_text(shapes: Tuple[Tuple[int, int, int, bool], ...]) -> str:
    return ", ".join(f"({r}, {i}) x {o}{' trains' if t else ''}" for r, i, o, t in shapes)


def _bound_onednn_cache() -> None:
    """Turn oneDNN's primitive cache off unless the user set its size (before its first use)."""
    import os

    # oneDNN caches a primitive per GEMM shape (up to 1,024) and, measured on the 26M LoRA
    # benchmark whose row counts change every step (labelled positions), peak RSS then grew
    # about 0.03 GiB a step (1.04 -> 1.29 GiB in 8 steps; a 64-entry cache: 1.30); without
    # the cache it stayed at 1.08-1.19, below MKL's 1.21, at the same step time. Rebuilding
    # costs 0.07 ms on a (64, 128) x (128, 384) product and 1.5 ms on a (6816, 128) x (128, 384)
    # one (6.1 ms, still 1.7x faster than MKL's 10.2). Read by oneDNN when its cache is first
    # made, so set before the probe's first product; a user's own setting stands.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")


@functools.lru_cache(maxsize=16)
def onednn_linear_decision(shapes: Tuple[Tuple[int, int, int, bool], ...] = DEFAULT_LINEAR_SHAPES) -> Tuple[bool, str]:
    """Whether oneDNN's fp32 GEMM beats the default (MKL) one here, and why: (taken, reason).

    MKL picks its kernels by CPU vendor: on this project's AMD EPYC hosts it runs fp32 GEMMs at
    96-104 GFLOP/s per core where oneDNN, which picks by instruction set, reaches 185-239
    (2026-11-26, (2048, 512) x (512, 1536), forward, input and weight gradients). On Intel
    CPUs both are fast and this is expected to say no. Timed at the model's layer shapes
    (``shapes``, from :func:`linear_shapes`), forward and backward, in :data:`PROBE_ROUNDS`
    rounds, best of :data:`PROBE_TRIALS` each, interleaved (2-4 s at 33M parameters); taken
    when every round has MKL at :data:`TAKE_AT` x oneDNN's time or more, and only if the two
    results agree to fp32 rounding.

    The two libraries sum in different orders, so the decision changes a run's last bits, and a
    timing taken on a loaded host can flip it: recipes ask on rank 0 only and share its answer,
    and a decision with a margin (every round's ratio outside [:data:`KEEP_BELOW`,
    :data:`KEEP_ABOVE`]) is kept in :func:`probe_cache_path`, keyed by :func:`_probe_key` (CPU,
    torch, intra-op threads) and the shapes, and reused by every later run (delete the file to
    measure again). A borderline one is this run's only: MKL, measured again next time.
    ``HLM_ONEDNN_LINEAR=0`` turns it off, ``=1`` on, without the probe or the file. The reason
    lands in ``run.json`` (``cpu_linear_why``).

    Args:
        shapes (Tuple[Tuple[int, int, int, bool], ...]): (rows, in, out, weight trains) per
            distinct layer (:func:`linear_shapes`).
    """
    import os

    _bound_onednn_cache()
    forced = os.environ.get("HLM_ONEDNN_LINEAR", "").strip()
    if forced in ("0", "1"):
        on = forced == "1" and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        return on, f"HLM_ONEDNN_LINEAR={forced}: {'oneDNN' if on else 'MKL'} (no probe)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False, "this torch has no oneDNN linear op: MKL"
    key = f"{_probe_key()} | linear {_shapes_text(shapes)}"
    return kept_decision("onednn_linear", key, lambda: _probe_onednn(shapes), _probe_why, "onednn")


def _onednn_linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through :func:`onednn_linear`."""
    return onednn_linear(x, self.weight, self.bias)


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Route the fp32 GEMMs of ``model``'s ``nn.Linear`` and LoRA base layers through oneDNN.

    Exact ``nn.Linear`` modules (projections, MLP, output, LoRA's A and B) take
    :func:`_onednn_linear_forward`; ``LoRALinear`` modules already on :func:`_addmm_lora_forward`
    run their (unquantized) base product through :func:`onednn_linear`. QAT's fake-quantized
    and NF4 layers are left alone. The caller decides with :func:`onednn_linear_decision` at the
    model's :func:`linear_shapes` (CPU, fp32, eager).

    Args:
        model (torch.nn.Module): the unwrapped torchtune model, before compile.

    Returns:
        int: how many linear and LoRA base layers now multiply through oneDNN.
    """
    from torchtune.modules.peft import LoRALinear

    _bound_onednn_cache()  # every rank (only rank 0 probes), before its first oneDNN product
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and "forward" not in m.__dict__:
            m.forward = types.MethodType(_onednn_linear_forward, m)
            n += 1
        elif type(m) is LoRALinear and "forward" in m.__dict__ and not m._quantize_base:
            m._onednn_base = True
            n += 1
    return n


def use_blocked_causal_attention(model: torch.nn.Module, block: int = CAUSAL_BLOCK) -> int:
    """Let every causal torchtune ``MultiHeadAttention`` of ``model`` attend in query blocks.

    CPU only (the caller checks): CUDA's flash kernels already skip the hidden half. Modules
    not yet routed through :func:`_gqa_forward` (no grouped heads) are routed now; calls with a
    mask, dropout, a KV cache or fewer than ``2 * block`` tokens run as before.

    Args:
        model (torch.nn.Module): a torchtune model (unwrapped, eager).
        block (int): query rows per SDPA call.

    Returns:
        int: the number of attention modules that take blocks.
    """
    from torchtune.modules import MultiHeadAttention

    n = 0
    for m in model.modules():
        if isinstance(m, MultiHeadAttention) and m.is_causal and m.kv_cache is None:
            _route_attention(m)
            m._causal_block = block
            n += 1
    return n


ATTENTION_PROBE_TOKENS = 512  # the probe's row length (capped at the model's max_seq_len)
# Blocked attention is kept for the host when every round has it at 1.10x plain SDPA or more
# (kept off at 0.95x or less); in between each run measures again and takes it from 1.0x.
ATTENTION_KEEP = (0.95, 1.10)


def _probe_blocked_attention(num_heads: int, num_kv_heads: int, head_dim: int, seq_len: int) -> Dict[str, Any]:
    """fwd+bwd of one causal attention call, plain SDPA vs :func:`causal_sdpa_blocked`, at this shape."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, num_heads, seq_len, head_dim, generator=g).requires_grad_()  # (1, n_h, s, h_d)
    k = torch.randn(1, num_kv_heads, seq_len, head_dim, generator=g).requires_grad_()
    v = torch.randn(1, num_kv_heads, seq_len, head_dim, generator=g).requires_grad_()
    gqa = num_kv_heads < num_heads

    def plain() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).sum().backward()

    def blocked() -> None:
        causal_sdpa_blocked(q, k, v, enable_gqa=gqa).sum().backward()

    ratios, best = timing_rounds(plain, blocked, trials=3)
    lo, hi = ATTENTION_KEEP
    clear = all(r >= hi for r in ratios) or all(r <= lo for r in ratios)
    return {"blocked": min(ratios) >= 1.0, "clear": clear, "ratios": [round(r, 3) for r in ratios],
            "sdpa_ms": best[0] * 1e3, "blocked_ms": best[1] * 1e3, "band": f"{lo}-{hi}"}


def _attention_why(found: Dict[str, Any]) -> str:
    ratios = ", ".join(f"{r:.2f}" for r in found["ratios"])
    return (f"causal attention fwd+bwd: SDPA {found['sdpa_ms']:.2f} ms vs query blocks {found['blocked_ms']:.2f} ms, "
            f"SDPA/blocked {ratios} over {len(found['ratios'])} rounds: {'blocks' if found['blocked'] else 'one SDPA call'}")


def blocked_attention_decision(num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int) -> Tuple[bool, str]:
    """Whether attention in query blocks is the faster CPU path at this shape and thread count, and why.

    Measured on this host with the run's intra-op threads (many small SDPA calls may scale
    worse with threads than one large one), kept like the oneDNN probe's decisions (file
    ``blocked_attention.json``). ``HLM_BLOCKED_ATTENTION=0`` / ``=1`` decides without the probe.
    Rows shorter than two blocks run one causal call either way: nothing to measure.
    """
    import os

    forced = os.environ.get("HLM_BLOCKED_ATTENTION", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"HLM_BLOCKED_ATTENTION={forced} (no probe)"
    seq = min(max_seq_len, ATTENTION_PROBE_TOKENS)
    if seq < 2 * CAUSAL_BLOCK:
        return False, f"rows of at most {max_seq_len} tokens: one causal call (blocks start at {2 * CAUSAL_BLOCK})"
    key = f"{_probe_key()} | attention {num_heads}/{num_kv_heads} heads x {head_dim} at {seq} tokens"
    return kept_decision("blocked_attention", key, lambda: _probe_blocked_attention(num_heads, num_kv_heads, head_dim, seq),
                         _attention_why, "blocked", borderline=None)


def _addmm_lora_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``LoRALinear.forward`` with the adapter's scale and sum inside one GEMM (same math).

    Args:
        x (torch.Tensor): (..., in_dim).

    Returns:
        torch.Tensor: (..., out_dim) = base(x) + alpha / rank * lora_b(lora_a(dropout(x))).
    """
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])  # (N, in_dim): 2-D, so the in-place GEMM below acts on no view
    if self._quantize_base:
        from torchao.dtypes.nf4tensor import linear_nf4

        out = linear_nf4(input=x, weight=self.weight)
        if self.use_bias:
            out = out + self.bias
    elif getattr(self, "_onednn_base", False):
        out = onednn_linear(x, self.weight, self.bias)  # (N, out_dim), oneDNN's GEMM (use_onednn_linear)
    else:
        out = F.linear(x, self.weight, self.bias)  # (N, out_dim)
    if not self.disabled:
        a = self.lora_a(self.dropout(x))  # (N, r)
        # out += scale * a @ B^T inside the GEMM (beta = 1). In place: the base product's
        # backward needs x and W, never its output, so autograd allows it and no copy is made.
        out.addmm_(a, self.lora_b.weight.t(), alpha=self.alpha / self.rank)
    return out.view(*lead, out.shape[-1])


def use_addmm_lora(model: torch.nn.Module) -> int:
    """Route every torchtune ``LoRALinear`` of ``model`` through :func:`_addmm_lora_forward`.

    Exact ``LoRALinear`` only: DoRA and QAT-LoRA modules, and adapters whose ``lora_b`` is not
    a bias-free ``nn.Linear``, keep torchtune's forward.

    Args:
        model (torch.nn.Module): a torchtune model (unwrapped, before compile or wrapping).

    Returns:
        int: the number of modules changed.
    """
    from torchtune.modules.peft import LoRALinear

    n = 0
    for m in model.modules():
        if (type(m) is LoRALinear and type(m.lora_b) is torch.nn.Linear and m.lora_b.bias is None
                and "forward" not in m.__dict__):
            m.forward = types.MethodType(_addmm_lora_forward, m)
            n += 1
    return n


def _complex_rope_forward(self: Any, x: torch.Tensor, *, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torchtune's RoPE ``forward`` as one complex multiply (same rotation).

    Args:
        x (torch.Tensor): (b, s, n_h, h_d), pairs (x[2i], x[2i+1]) rotated by angle i.
        input_pos (Optional[torch.Tensor]): (b, s) or (s,) positions; None = 0..s-1.

    Returns:
        torch.Tensor: (b, s, n_h, h_d), x's dtype.
    """
    if not getattr(self, "is_cache_built", True):
        raise RuntimeError("RoPE cache is not built. Please call rope_init() first.")
    s = x.size(1)
    cache = self.cache[:s] if input_pos is None else self.cache[input_pos]  # (..., s, h_d/2, 2): cos, sin
    rot = torch.view_as_complex(cache.float().contiguous())  # (..., s, h_d/2): cos + i sin
    rot = rot.view(-1, s, 1, rot.size(-1))  # (1 or b, s, 1, h_d/2), as torchtune broadcasts
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())  # (b, s, n_h, h_d/2)
    # (x0 + i x1)(cos + i sin) = (x0 cos - x1 sin) + i (x1 cos + x0 sin): torchtune's pair rotation
    return torch.view_as_real(xc * rot).flatten(3).type_as(x)


def use_complex_rope(model: torch.nn.Module) -> int:
    """Route torchtune's RoPE modules (``RotaryPositionalEmbeddings``, ``Llama3ScaledRoPE``)
    through :func:`_complex_rope_forward`.

    Eager mode only: the caller leaves compiled models alone (complex tensors are a weak
    spot of inductor's code generation).

    Args:
        model (torch.nn.Module): a torchtune model (unwrapped).

    Returns:
        int: the number of modules changed.
    """
    from torchtune.models.llama3_1 import Llama3ScaledRoPE
    from torchtune.modules import RotaryPositionalEmbeddings

    n = 0
    for m in model.modules():
        if type(m) in (RotaryPositionalEmbeddings, Llama3ScaledRoPE) and "forward" not in m.__dict__:
            m.forward = types.MethodType(_complex_rope_forward, m)
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


def _last_layer_at_targets(layer: Any, x: torch.Tensor, idx: torch.Tensor, mask: Any,
                           input_pos: Optional[torch.Tensor], gqa: bool) -> torch.Tensor:
    """torchtune's ``TransformerSelfAttentionLayer.forward`` evaluated at positions ``idx`` only.

    Every position's keys and values are computed (the queries attend to them); queries,
    attention output, the residuals and the MLP run at the ``Tq`` chosen positions per row.
    With the causal (or given) mask of each chosen query row, the outputs equal torchtune's
    outputs at those positions.

    Args:
        layer (Any): a torchtune ``TransformerSelfAttentionLayer`` with a ``MultiHeadAttention``.
        x (torch.Tensor): (B, T, D) the layer's input.
        idx (torch.Tensor): (B, Tq) int64 sequence indices to evaluate; padding slots (outputs
            dropped) hold 0, a query row every causal or packed-document mask lets see key 0.
        mask (Any): None (causal) or a boolean (B, T, T) mask, True = attend.
        input_pos (Optional[torch.Tensor]): (B, T) positions, or None (position = index).
        gqa (bool): let SDPA read grouped K/V heads (``enable_gqa``) instead of copying them.

    Returns:
        torch.Tensor: (B, Tq, D), the layer's output at ``idx``.
    """
    attn = layer.attn
    b, t, d = x.shape
    tq = idx.shape[1]
    rows = idx[:, :, None].expand(b, tq, d)  # (B, Tq, D) gather index
    h = layer.sa_norm(x)  # (B, T, D): per position, needed everywhere for K/V
    q = attn.q_proj(h.gather(1, rows)).view(b, tq, attn.num_heads, attn.head_dim)  # (B, Tq, n_h, h_d)
    k = attn.k_proj(h).view(b, t, -1, attn.head_dim)  # (B, T, n_kv, h_d)
    v = attn.v_proj(h).view(b, t, -1, attn.head_dim)
    if attn.pos_embeddings is not None:
        q = attn.pos_embeddings(q, input_pos=idx if input_pos is None else input_pos.gather(1, idx))
        k = attn.pos_embeddings(k, input_pos=input_pos)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, s, h_d)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    if mask is None:  # causal over sequence indices, as SDPA's is_causal in torchtune's layer
        allowed = torch.arange(t, device=x.device)[None, None, :] <= idx[:, :, None]  # (B, Tq, T)
    else:
        allowed = mask.gather(1, idx[:, :, None].expand(b, tq, t))  # the chosen query rows
    if not gqa and attn.num_kv_heads != attn.num_heads:  # torchtune's copy of K/V to every head
        k = k.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=1)
        v = v.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[:, None], dropout_p=attn.attn_dropout if attn.training else 0.0,
        enable_gqa=gqa and attn.num_kv_heads != attn.num_heads,
    )  # (B, n_h, Tq, h_d)
    out = attn.output_proj(out.transpose(1, 2).reshape(b, tq, -1))  # (B, Tq, D)
    h = layer.sa_scale(out) + x.gather(1, rows)
    return h + layer.mlp_scale(layer.mlp(layer.mlp_norm(h)))


def prunable_last_layer(model: torch.nn.Module) -> Any:
    """The model's last layer if :func:`_last_layer_at_targets` can stand in for it, else None."""
    from torchtune.modules import MultiHeadAttention, TransformerSelfAttentionLayer

    layers = getattr(model, "layers", None)
    if not layers:
        return None
    layer = layers[-1]
    # A checkpoint wrapper recomputes the forward in backward, after the block has restored it;
    # a compiled layer would recompile for the swapped forward.
    if type(layer) is not TransformerSelfAttentionLayer and not (
            isinstance(layer, TransformerSelfAttentionLayer) and type(layer).__name__.startswith("FSDP")):
        return None
    if getattr(layer, "_compiled_call_impl", None) is not None or "forward" in layer.__dict__:
        return None
    attn = layer.attn
    if not isinstance(attn, MultiHeadAttention) or attn.kv_cache is not None or not attn.is_causal:
        return None
    return layer


@contextlib.contextmanager
def target_positions_only(model: torch.nn.Module, keep: torch.Tensor, *, chunked: bool = False) -> Iterator[None]:
    """Within the block, ``model(...)`` returns fp32 logits of the kept positions only.

    The final norm and the output projection run inside the model's forward (so DDP and
    FSDP see every parameter used there), on ``h[keep]`` instead of every position; the
    norm is per position, so selecting first changes nothing but the work.

    With ``chunked`` (on CPU, where the (N, V) logits exceed :data:`CE_CHUNK_ELEMENTS`) the
    projection runs in row chunks and the forward returns the list of (n_i, V) chunks, for
    :func:`chunked_cross_entropy`: neither the whole logits nor their whole gradient is ever
    allocated. One (2044, 8000) gradient assembled from its chunks (autograd's ``split``
    backward, a ``cat`` into 65 MB of fresh pages) cost 31 ms at one thread, more than the
    chunks' log-softmax; per chunk the projection's GEMM and the gradient stay cache-sized.

    Args:
        model (torch.nn.Module): a torchtune ``TransformerDecoder`` (unwrapped; the call may
            go through a wrapper).
        keep (torch.Tensor): (B, T) bool, True where the shifted label is a target.
        chunked (bool): return row chunks of the logits where :func:`ce_chunk_rows` says so.

    Yields:
        None: inside, the forward returns (N, V) logits (or their row chunks, in order), N =
        ``keep.sum()``, in row-major order of ``keep`` (the order of ``labels[keep]``).
    """
    own = model.__dict__.get("unembed")
    layer = prunable_last_layer(model) if bool(keep.any()) else None
    select = keep  # which rows of the last layer's output go to the head
    if layer is not None:
        counts = keep.sum(dim=1)  # (B,)
        tq = int(counts.max())
        # Kept indices first, in ascending position (stable sort), then padding slots.
        idx = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :tq]  # (B, Tq)
        select = torch.arange(tq, device=keep.device)[None, :] < counts[:, None]  # (B, Tq) real slots
        idx = torch.where(select, idx, torch.zeros_like(idx))  # padding: position 0 (attends to itself)
        # routed through _gqa_forward (use_gqa_attention or use_blocked_causal_attention): SDPA reads
        # grouped heads itself; _last_layer_at_targets asks for it only where the heads are grouped
        gqa = "_torchtune_forward" in layer.attn.__dict__

        def last_layer(x: torch.Tensor, *, mask: Any = None, input_pos: Optional[torch.Tensor] = None,
                       **kwargs: Any) -> torch.Tensor:  # x: (B, T, D) -> (B, Tq, D)
            if mask is None or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 3):
                return _last_layer_at_targets(layer, x, idx, mask, input_pos, gqa)
            # Another mask kind (e.g. flex attention's BlockMask): the whole layer, then the rows.
            out = type(layer).forward(layer, x, mask=mask, input_pos=input_pos, **kwargs)  # (B, T, D)
            return out.gather(1, idx[:, :, None].expand(-1, -1, out.shape[-1]))

        layer.forward = last_layer

    vocab = output_vocab_size(model.output) if chunked else None

    def unembed(h: torch.Tensor) -> Any:  # h: (B, T, D), or (B, Tq, D) from last_layer
        x = model.norm(h[select])  # (N, D)
        rows = ce_chunk_rows(x.shape[0], vocab, x.device) if vocab else 0
        if rows:
            return [model.output(c).float() for c in x.split(rows)]  # [(n_i, V)], sum n_i = N
        return model.output(x).float()  # (N, V)

    model.unembed = unembed
    try:
        yield
    finally:
        if layer is not None:
            del layer.forward
        if own is None:
            del model.unembed
        else:
            model.unembed = own


def _swiglu_inference_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """torchtune's ``FeedForward.forward`` (``w2(silu(w1 x) * w3 x)``) with the elementwise ops in place.

    ``silu(w1 x)`` and the product overwrite ``w1 x``, a tensor nothing else holds: the same
    elementwise results, two fewer (tokens, hidden) allocations per call. Meant for inference;
    under autograd PyTorch keeps what the in-place ops' backward needs, so gradients stay
    torchtune's (tested), but training gains nothing from it.

    Args:
        x (torch.Tensor): (..., in_dim).

    Returns:
        torch.Tensor: (..., out_dim).
    """
    h = F.silu(self.w1(x), inplace=True)  # (..., hidden)
    return self.w2(h.mul_(self.w3(x)))


@contextlib.contextmanager
def inference_fastpath(model: torch.nn.Module) -> Iterator[Dict[str, int]]:
    """Within the block, ``model``'s RoPE and SwiGLU modules run their inference fast paths.

    RoPE takes :func:`_complex_rope_forward` (as the recipes do), torchtune ``FeedForward``
    modules with a SiLU gate take :func:`_swiglu_inference_forward`; modules already patched
    are left alone, and every patch is undone on exit. Eager models only (the caller skips
    compiled ones: complex tensors are a weak spot of inductor). Measured by
    ``benchmarks/eval_throughput.py``.

    Args:
        model (torch.nn.Module): a torchtune model (unwrapped), in eval mode.

    Yields:
        Dict[str, int]: how many RoPE and feed-forward modules were patched.
    """
    from torchtune.models.llama3_1 import Llama3ScaledRoPE
    from torchtune.modules import FeedForward, RotaryPositionalEmbeddings

    patched = []
    counts = {"rope": 0, "swiglu": 0}
    for m in model.modules():
        if "forward" in m.__dict__:
            continue
        if type(m) in (RotaryPositionalEmbeddings, Llama3ScaledRoPE):
            m.forward = types.MethodType(_complex_rope_forward, m)
            counts["rope"] += 1
        elif type(m) is FeedForward and m.w3 is not None and type(m.activation) is torch.nn.SiLU:
            m.forward = types.MethodType(_swiglu_inference_forward, m)
            counts["swiglu"] += 1
        else:
            continue
        patched.append(m)
    try:
        yield counts
    finally:
        for m in patched:
            del m.forward


def query_logits(model: torch.nn.Module, tokens: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 logits of a torchtune ``TransformerDecoder`` at positions ``idx`` only.

    torchtune's forward without a mask (causal) and with positions 0..T-1, except that the last
    layer runs its queries, attention output and MLP at ``idx`` only (:func:`_last_layer_at_targets`)
    and the final norm and the vocabulary projection see those rows alone. A plain function of
    tensors, so ``torch.compile`` of it specializes once on fixed shapes (no module state swapped
    per call, as :func:`target_positions_only` does). The caller checks the model with
    :func:`prunable_last_layer` (and that it has no intermediate hidden-state outputs).

    Args:
        model (torch.nn.Module): an unwrapped ``TransformerDecoder``.
        tokens (torch.Tensor): (B, T) token ids.
        idx (torch.Tensor): (B, Tq) int64 positions to evaluate, in any order; padding slots
            hold 0 (their outputs are the caller's to drop).

    Returns:
        torch.Tensor: (B, Tq, V) float32 logits at ``idx``.
    """
    layers = model.layers
    h = model.tok_embeddings(tokens)  # (B, T, D)
    for layer in layers[:-1]:
        h = layer(h)
    gqa = "_torchtune_forward" in layers[-1].attn.__dict__  # routed through _gqa_forward: SDPA reads grouped heads
    h = _last_layer_at_targets(layers[-1], h, idx, None, None, gqa)  # (B, Tq, D)
    return model.output(model.norm(h)).float()  # (B, Tq, V)


CE_CHUNK_ELEMENTS = 1 << 21  # rows per chunk x vocabulary; see chunked_cross_entropy


def output_vocab_size(output: Any) -> Optional[int]:
    """Rows of an output projection (``nn.Linear``, LoRA or torchtune's ``TiedLinear``), or None."""
    if isinstance(getattr(output, "out_features", None), int):
        return output.out_features
    if isinstance(getattr(output, "out_dim", None), int):  # torchtune LoRALinear
        return output.out_dim
    weight = getattr(getattr(output, "tied_module", None), "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None


def ce_chunk_rows(n: int, vocab: int, device: torch.device) -> int:
    """Rows per chunk of :func:`chunked_cross_entropy` for (n, vocab) logits, or 0 for one call.

    CPU only (measured there; a GPU takes one call), and only where the logits span more than
    one chunk of :data:`CE_CHUNK_ELEMENTS`.
    """
    rows = max(1, CE_CHUNK_ELEMENTS // max(1, vocab))
    return rows if device.type == "cpu" and n > rows else 0


def chunked_cross_entropy(logits: Any, targets: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of (N, V) logits over row chunks of about 2M elements (on CPU).

    The same values as one ``F.cross_entropy(..., reduction=reduction)`` (each row's term is
    computed alone; for ``sum`` only the order of the final additions differs). Chunks keep
    each log-softmax and its gradient cache-sized: in a LoRA step at an 8,000-token
    vocabulary, one (2044, 8000) log-softmax forward and backward took 2.6 s per 8 steps,
    torchtune's eight chunks 0.84 s, these chunks under 0.25 s (torch.profiler, one thread;
    docs/benchmarks.md). Logits already in row chunks (``target_positions_only(...,
    chunked=True)``) are taken as they are, so no (N, V) tensor is built.

    Args:
        logits (torch.Tensor | list[torch.Tensor]): (N, V) float logits, or their row chunks
            [(n_i, V)] in order.
        targets (torch.Tensor): (N,) class indices.
        reduction (str): ``sum`` (a scalar) or ``none`` ((N,) per-row terms).

    Returns:
        torch.Tensor: the scalar sum, or the (N,) terms in row order.
    """
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction={reduction!r}: sum or none")
    if isinstance(logits, (list, tuple)):
        chunks, sizes = list(logits), [c.shape[0] for c in logits]
        if sum(sizes) != targets.shape[0]:
            raise ValueError(f"logit chunks hold {sum(sizes)} rows, targets {targets.shape[0]}")
        tchunks = targets.split(sizes)
    else:
        rows = ce_chunk_rows(logits.shape[0], logits.shape[-1], logits.device)
        if not rows:
            return F.cross_entropy(logits, targets, reduction=reduction)
        chunks, tchunks = logits.split(rows), targets.split(rows)
    parts = [F.cross_entropy(lc, tc, reduction=reduction) for lc, tc in zip(chunks, tchunks)]
    return torch.cat(parts) if reduction == "none" else sum(parts)
