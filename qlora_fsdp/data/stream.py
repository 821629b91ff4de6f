"""--dataset_streaming: rows read and tokenized as training goes, instead of through the tokenized cache.

The sources' rows are dealt out by position, row i to rank i % world_size, so each rank reads (and validates)
every row but tokenizes only its own, and training starts after the first batch rather than after a full pass.
A rank's stream never ends: when its share of the sources is used up it starts the next pass, so every rank takes
the same number of batches per step whatever its share holds, and the data position is one number, the
micro-batches consumed, which a resumed run skips (re-reading, not training on, what came before). Rows come in
the sources' order: there is no global shuffle without the whole dataset.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from qlora_fsdp.data.formats import AnyExample, Sample, encode_examples, row_example
from qlora_fsdp.data.rows import assign_rows, fit_sample, packed_row
from qlora_fsdp.data.sources import check_source, read_rows, source_names
from qlora_fsdp.errors import UserError

ENCODE_BATCH = 64
"""A rank's examples are tokenized this many at a time (one tokenizer call, not one per row)."""
PACK_BUFFER = 1024
"""With --packing, samples are packed in groups of this many as they arrive (best-fit decreasing within each)."""


class StreamRows(IterableDataset):
    """This rank's rows of --dataset, tokenized and fitted to the context as they are read; endless (see above)."""

    def __init__(
        self,
        dataset: str,
        tokenizer: Any,
        *,
        samples: int,
        prompt_style: str,
        context_length: int,
        train_on_inputs: bool,
        packing: bool,
        packing_split: bool,
        rank: int,
        world_size: int,
    ) -> None:
        self.names = source_names(dataset)
        for name in self.names:
            check_source(name)  # a wrong path fails now, not after the model has loaded
        self.tokenizer, self.samples, self.prompt_style = tokenizer, samples, prompt_style
        self.context_length, self.train_on_inputs = context_length, train_on_inputs
        self.packing, self.packing_split = packing, packing_split
        self.rank, self.world_size = rank, world_size

    def samples_of_pass(self) -> Iterator[Sample]:
        """This rank's samples of one pass over the sources, in order.

        Every rank validates every row (cheap beside tokenizing its own), so a bad row stops every rank, not one
        while the others wait for it in a collective.
        """
        mine: list[AnyExample] = []
        position = 0
        for name in self.names:
            for where, row in read_rows(name, samples=self.samples, streaming=True):
                example = row_example(row, where, prompt_style=self.prompt_style)
                if position % self.world_size == self.rank:
                    mine.append(example)
                    if len(mine) == ENCODE_BATCH:
                        yield from self._fit(mine)
                        mine = []
                position += 1
        yield from self._fit(mine)
        if position < self.world_size:
            raise UserError(
                f"--dataset {','.join(self.names)}: {position} rows for {self.world_size} ranks; every rank needs "
                "rows of its own: use more data or fewer ranks"
            )

    def _fit(self, examples: list[AnyExample]) -> Iterator[Sample]:
        for sample in encode_examples(examples, self.tokenizer, train_on_inputs=self.train_on_inputs):
            yield from fit_sample(sample, self.context_length, split=self.packing_split)[0]

    def rows_of_pass(self) -> Iterator[dict[str, list[int]]]:
        """This rank's rows of one pass: one sample each, or packed a buffer at a time."""
        samples = self.samples_of_pass()
        if not self.packing:
            yield from ({"input_ids": ids, "labels": labels} for ids, labels in samples)
            return
        while buffer := list(itertools.islice(samples, PACK_BUFFER)):
            for group in assign_rows([len(ids) for ids, _ in buffer], self.context_length):
                yield packed_row([buffer[index] for index in group])

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        for _ in itertools.count():
            empty = True
            for row in self.rows_of_pass():
                empty = False
                yield row
            if empty:
                raise UserError(
                    f"--dataset {','.join(self.names)}: rank {self.rank} of {self.world_size} got no row with "
                    "anything to learn in a whole pass; use more data or fewer ranks"
                )
