"""autopar.ops: the operators the passes insert and the runtime executes.

``collectives`` (autograd-correct collectives and the byte convention), ``cp_attention``
(ring, all-gather and Ulysses attention, CP positions and cumulative sums), ``moe``
(dispatch, the local experts, combine), ``zero_gather`` (ZeRO-3's parameter gather),
``rng`` (dropout drawn from per-stream generators), ``draws`` (a random draw over a dp
rank's rows made for the whole batch), ``recompute`` (checkpointed regions),
``regather`` (SP's saved sequence shard, all-gathered again in backward), ``schedules``
(pipeline schedules as data) and ``step`` (the step context they all read).  The only
runtime code ``passes/`` may import.
"""
