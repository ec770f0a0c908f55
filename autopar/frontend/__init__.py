"""autopar.frontend: from the user's model to an analysed FX graph (the first stage).

``trace`` (torch.export, non-strict, symbolic batch and sequence), ``analyze`` (embedding,
decoder layers, attention, MLP, norms, head, by dataflow and ``nn_module_stack``) and
``analyze_moe`` (MoE routers and experts), over the FX helpers of ``fx_utils``.
"""
