"""autopar.passes (folder ``passes/``): the graph passes that rewrite a traced model for a plan.

The front half of the compiler, without a process group: :func:`compile.compile_program`
traces the model (:mod:`autopar.frontend`), runs ``cleanup`` and ``causal_mask``, analyses the
structure, validates the plan, and runs the passes of :func:`runner.default_passes`; its
result is a :class:`context.CompiledProgram`, which :mod:`autopar.runtime` turns into one
rank's program.

The contract and the runner:

- ``context``: the pass contract: ``PassInputs`` (plan, structure, symbols, options),
  ``Decisions`` (what the passes before decided), ``PassContext`` (both, frozen),
  ``PassResult`` (one pass's decisions), ``CompiledProgram``, ``Provenance`` and the node
  metadata keys;
- ``runner``: ``run_passes`` (in order, the graph linted after each pass, the code generated
  once at the end, a failure named with the passes before it) and ``default_passes`` (the
  order below, the passes of axes the plan does not use skipped);
- ``compile``: ``compile_program``, the whole front half.

The passes, in the order they run:

1. ``cleanup``: one name per tied tensor, export's shape checks and identity slices dropped;
2. ``causal_mask``: masks proven causal become ``is_causal=True``, masks allowing every
   position are dropped;
3. ``tensor_parallel`` (tp): column / row shards, region entries, vocabulary-parallel
   embedding and loss;
4. ``sequence_parallel`` (tp with sp): entries and reductions become all-gathers and
   reduce-scatters along the sequence;
5. ``expert_parallel``: MoE experts become dispatch / local experts / combine;
6. ``shard_propagation``: placements of every node on the tracked axes, local sizes,
   gradient placements (``gradient_placement``), predicted bytes;
7. ``context_parallel`` (cp): attention becomes a CP variant, positions global, placements
   on ``cp``;
8. ``batch_propagation`` (dp or micro-batches): placements on ``dp``, statistics over the
   batch all-reduced;
9. ``dropout``: each dropout draws from the stream its placement calls for;
10. ``data_parallel``: the gradient-sync buckets;
11. ``zero`` (ZeRO stage 3): parameters gathered per unit before first use;
12. ``recompute``: recomputed regions become checkpointed bodies;
13. ``pipeline`` (pp): the graph cut into chunks.

The sharding-rule registry: ``rules`` (the table, ``RuleContext``, shared helpers) and the
families registered into it: ``pointwise_rules``, ``reduction_rules``, ``matmul_rules``,
``view_rules``, ``moe_rules``, ``op_rules`` (autopar's own operators), and the data axes'
token-order rules (``token_order`` the placements, ``token_order_rules``, ``token_order_rowwise``:
a rank's tokens regrouped by an MoE block run as traced); ``op_sets`` holds the
op sets that include autopar's operators (the aten ones are :mod:`autopar.frontend.op_sets`).
Imports: :mod:`autopar.ops`, :mod:`autopar.frontend`, :mod:`autopar.cost` and layer 0
(docs/architecture.md).
"""
