"""hlmtune: torchtune recipe pack for LLM and Heart Language Model fine-tuning and profiling."""
__version__ = "0.1.0"

import logging as _logging

# torchao warns at import that Triton is missing; on CPU that is expected, not actionable.
_logging.getLogger("torchao.kernel.intmm").setLevel(_logging.ERROR)
