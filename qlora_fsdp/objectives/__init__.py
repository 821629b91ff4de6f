"""Training objectives: what a batch's loss is, what it is divided by, what the step logs besides the loss, and what
each objective needs set up (its rows, a reference, sampled completions).

The loop and evaluation call an Objective and nothing else about it (`base.py`); the trainer builds one through its
spec (`specs.py`) and run hooks (`setup.py`). Supervised fine-tuning (`sft.py`), the preference objectives on pairs
(`preference.py`), KTO on unpaired completions (`kto.py`) and GRPO on the completions it samples (`grpo.py`, with
`sampling.py` and `rewards.py`); the loss inside the FSDP root they all read is `loss.py`.
"""
