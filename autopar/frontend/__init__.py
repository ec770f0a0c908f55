"""autopar.frontend: from the user's model to an analysed FX graph (the compiler's first step).

``trace`` (torch.export, non-strict, symbolic batch and sequence, with the loss), ``stamp``
(deep models traced in time flat in their depth: a few layers exported, the repeats copied)
and ``stamp_behaviour`` (the check that every copied layer behaves like its exported twin),
``analyze`` (embedding, decoder layers, attention, MLP, norms, head, by dataflow and
``nn_module_stack``) and ``analyze_moe`` (MoE routers and experts), ``attention_dims`` (the
heads of an attention op or an eager core, the GQA broadcast), ``spec_dims`` (the cost
model's fields read from the graph), ``loss`` (how the traced loss reduces over tokens),
``target`` (loading a user's ``MODULE:FUNCTION``), over ``fx_utils`` (where a node came
from, reshape chains) and ``op_sets`` (the aten op families the analysis and the passes
match, each written once).  Imports only layer 0 (docs/architecture.md).
"""
