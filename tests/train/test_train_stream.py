"""The step's micro-batch stream holds a small prefetch window of packs, never the whole step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mindvl.train.step import MicroBatchStream


def test_stream_keeps_at_most_the_window_alive():
    refs: list[weakref.ref] = []
    made = []

    class Batch(dict):  # a dict the stream passes through unchanged on CPU; weakref-able to count live ones
        pass

    def fetch():
        b = Batch(input_ids=torch.zeros(5 + len(made), dtype=torch.long))
        refs.append(weakref.ref(b))
        made.append(len(made))
        return b

    stream = MicroBatchStream(fetch, 7, torch.device("cpu"), window=2)
    sizes = []
    for batch in stream:
        gc.collect()
        assert sum(r() is not None for r in refs) <= 2 + 1  # the window, plus the batch the consumer holds
        sizes.append(batch["input_ids"].numel())
        del batch
    assert sizes == [5 + i for i in range(7)]  # every micro-batch once, in order
    assert stream.real_tokens == sum(sizes)
    with pytest.raises(ValueError, match="window"):
        MicroBatchStream(fetch, 1, torch.device("cpu"), window=0)
