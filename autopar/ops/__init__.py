"""autopar.ops: the operators the passes insert and the runtime executes.

``collectives`` (autograd-correct collectives and the byte convention), ``cp_attention``
(ring, all-gather and Ulysses attention), ``moe`` (dispatch and combine), ``zero_gather``
(ZeRO-3's parameter gather), ``random`` (dropout streams), ``recompute`` (checkpointed
regions), ``schedules`` (pipeline schedules as data) and ``step`` (the step context they all
read).  The only runtime code ``passes/`` may import.
"""
