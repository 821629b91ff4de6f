"""The data path, one stage per module, each calling only the stages below it:

sources (files, hub, named datasets) -> formats (rows -> examples -> ids and labels) -> rows (cut, pack, pad per
batch) -> cache (tokenized once into Arrow, shared by the ranks and later runs) -> loader (samplers, DataLoaders).
"""

from qlora_fsdp.data.formats import IGNORE_INDEX, target_mask

__all__ = ["IGNORE_INDEX", "target_mask"]
