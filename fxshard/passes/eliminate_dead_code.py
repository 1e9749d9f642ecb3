"""eliminate_dead_code_pass: drop computations whose results nobody reads, random ones included.

AOTAutograd's partitioner copies impure forward nodes into backward even when
backward never reads them: with dropout, backward recomputes the forward's
``native_dropout`` (result unused), and the matmul that feeds it, and the
gather of that layer's weight::

    before:  w = unshard(shard); ...; addmm(b, x, t(view(w))); relu; native_dropout   (all dead)
    after:   (gone)

fx's own dead-code elimination keeps them because random ops count as
impure. Here a random op whose result is unused is dropped too: not running it
also keeps the random stream where eager mode leaves it. Collectives, waits,
``fxshard.free`` and mutations are never dropped.
"""

from __future__ import annotations

import torch.fx as fx

from .context import PassContext


def _must_keep(node: fx.Node) -> bool:
    return node.op in ("placeholder", "output") or node.is_impure(impure_random=False)


def eliminate_dead_code_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not gm.graph.eliminate_dead_code(is_impure_node=_must_keep):
        return gm
    gm.recompile()
    return gm
