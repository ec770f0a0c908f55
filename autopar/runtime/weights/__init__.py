"""Weights in and out: this rank's parameters, and every way values enter or leave them.

- ``parameters`` (``RankParameters``: names, aliases, dtypes, tensors without values yet, the
  shard layout, reading and writing local pieces; what the modules below take instead of the
  ``ParallelModule``), ``layout`` (cutting full tensors into shards and back);
- ``state`` (state dicts and checkpoint state), ``train_state`` (the step, dropout's RNG and the
  data position in a checkpoint), ``checkpoint`` (DCP save and load), ``checkpoint_files`` (the
  layout on disk, retention, ``latest_checkpoint``, the checks of a damaged checkpoint),
  ``checkpoint_writer`` (background writes);
- ``pretrained`` (``pm.load_pretrained``), ``export`` (``pm.export_weights``), ``safetensors_io``
  (slice reads and piecewise writes of safetensors files), ``initialize`` (``init_weights`` on a
  model built on the meta device; ``init_tracker``: what each call of ``fn`` reads and writes).

Neighbours: gradient sync and ZeRO (where a written value lands: the parameter, its fp32
master, its ZeRO shard) in :mod:`autopar.runtime.gradients`; the step in
:mod:`autopar.runtime.stepping`.
"""
