"""The plan report's numbers read at every scale (issue 43 item 9): a tiny recipe's memory parts and parameter count
are not "0.0 GiB" and "0.00B"."""

from __future__ import annotations

from mindvl.plan.planner import _count, _gib


def test_bytes_and_counts_keep_their_digits_at_every_scale():
    assert [_gib(n) for n in (0, 1536, 5 * 2**20, 200 * 2**20, 26.4 * 2**30)] == \
        ["0.0 GiB", "1.5 KiB", "5.0 MiB", "0.2 GiB", "26.4 GiB"]
    assert [_count(n) for n in (77_352, 1_250_000, 8_290_000_000)] == ["77,352", "1.25M", "8.29B"]
