"""The one place that touches torchtune internals (private modules, underscore names).

torchtune 0.6.1 is frozen upstream; torchao moves on. Everything here is either a private
torchtune name we depend on, or a shim for a torchao API change, so a version bump is a
one-file review. Public torchtune APIs (``torchtune.training``, ``torchtune.modules`` ...)
are imported directly where used.
"""

from __future__ import annotations

from typing import Dict


def llama3_special_tokens() -> Dict[str, int]:
    """Llama3's 256 special tokens and their ids (``torchtune.models.llama3._tokenizer``)."""
    from torchtune.models.llama3._tokenizer import LLAMA3_SPECIAL_TOKENS

    return dict(LLAMA3_SPECIAL_TOKENS)
