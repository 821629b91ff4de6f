"""Training objectives: what a batch's loss is, what it is divided by, and what the step logs besides the loss.

The training loop and evaluation call an Objective and nothing else about it (`base.py`); supervised fine-tuning's
token-level cross-entropy is one of them (`sft.py`).
"""

from qlora_fsdp.objectives.base import Forward, Objective
from qlora_fsdp.objectives.sft import SftObjective

__all__ = ["Forward", "Objective", "SftObjective"]
