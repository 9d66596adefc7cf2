"""Dynamo's recompile limit, raised for mindvl's compiled pieces: the decode step's layers (infer.decode_compile)
and the training blocks (train.parallel's regional compile).

Dynamo keeps at most `config.recompile_limit` graphs per code object (8 by default) and then runs that code eagerly
for the rest of the process, saying so in a log line only. The code objects mindvl's compiled pieces run are the
models' own methods (a block's forward; with the graph breaks at the attention and the cache, each attention's
forward and DecoderLayer.decode_forward are frames of their own), which every model of a process shares: one graph
per layer kind (dense, MoE, linear or full attention; in decode, the first layer without a pending residual), dtype,
grad mode and shape regime (static, then dynamic). A process that runs a few models one after another needs more
than 8: after the four test families, a fifth model's decode ran 8 of its 72 graph calls compiled and the rest
eagerly; after three families trained and evaluated, a fourth one's blocks ran 72 of their 168 (RESULTS.md,
session 18; tests/test_decode_compile.py and tests/test_compile_guards.py check the raise).

The limit is a process-wide setting (others who compile per model raise it too): raised to RECOMPILE_LIMIT, never
lowered.
"""

from __future__ import annotations

RECOMPILE_LIMIT = 64


def make_room_for_graphs() -> None:
    """Dynamo's recompile limit raised to RECOMPILE_LIMIT unless it is already higher (a user's choice stays)."""
    from torch._dynamo import config  # loaded by torch.compile anyway

    if config.recompile_limit < RECOMPILE_LIMIT:
        config.recompile_limit = RECOMPILE_LIMIT
