"""hlmtune: torchtune recipe pack for LLM and Heart Language Model fine-tuning and profiling."""
__version__ = "0.1.0"
