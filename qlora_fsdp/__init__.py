"""qlora-fsdp: quantized LoRA fine-tuning of causal LMs across processes with FSDP."""

__version__ = "0.1.0"
