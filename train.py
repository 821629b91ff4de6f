"""Entry point: `torchrun --nproc_per_node=N train.py --model ... --quant bnb|hqq|none`."""

import fire

from qlora_fsdp.cli import main

if __name__ == "__main__":
    fire.Fire(main)
