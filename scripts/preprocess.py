"""Tokenize a dataset into the cache training reads, ahead of a GPU job: the same flags and --config as train.py.

python scripts/preprocess.py --model MODEL --dataset DATA [--context_length N ...] [--config FILE.yaml]

Prints the cache's path and its examples, samples and tokens; a training run with the same data flags then starts
from it ("tokenized cache reused"). The logic lives in qlora_fsdp/data/.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fire

from qlora_fsdp.cli import preprocess  # after the sys.path set-up above

if __name__ == "__main__":
    fire.Fire(preprocess)
