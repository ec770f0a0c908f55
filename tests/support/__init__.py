"""The test suite's support code: not tests, imported by the tests of every tier.

* ``harness``: the pooled gloo workers that run a job on every rank (``dist_pool`` in
  ``tests/conftest.py``); ``reference``: the single-process side of the equivalence tests
  (reference training, the bounds, the batches), re-exported by ``harness``;
* ``models``: the models the suite trains (the example decoder of ``examples/model.py``, tiny
  Hugging Face models); ``trace_cache``: each distinct model exported once per process;
* ``jobs`` and ``*_jobs``: the per-rank functions the multi-rank tests run on the pools
  (workers import them by module name, ``tests.support.<module>``);
* ``comm_check``: the collectives a run recorded against the cost model's;
* ``scale``: one rank of a full-size model compiled under a fake process group, its
  collectives against the cost model's (tests/e2e and ``benchmarks/scale_simulation.py``);
* ``zoo``: the sweep over transformers' causal LMs (tests/e2e/test_zoo.py and
  ``benchmarks/zoo.py``).
"""
