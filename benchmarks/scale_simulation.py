"""Scale simulation: compile and step one rank of a full-size model in one CPU process, count its bytes.

A Llama-shaped ``transformers.LlamaForCausalLM`` at full width (``--model``: a dense preset of
``autopar.ModelSpec``, default Llama-3-70B, hidden 8192; ``--layers`` overrides the depth) is
built on the meta device (no memory), compiled by ``autopar.parallelize`` for ``--plan`` as rank
``--rank`` of a *fake* process group of the plan's world size (``torch.distributed`` backend
"fake": every collective is a no-op), so it is that rank's pipeline stage that compiles, and
stepped once.  The runtime records every collective of the rank exactly as on a real cluster;
they are compared call for call and byte for byte with the cost model's ``comm_table(stage)``
for the same shapes, and the rank's parameter bytes with the cost model's parameter memory
(fp32, ``dtype_bytes=4``, the meta model's dtype).  The exit status is non-zero when anything
differs.

Mixture-of-experts presets with an MoE block in every layer and no shared experts
(``mixtral-8x7b``) build a ``MixtralForCausalLM``.  Routing depends on the data, which a
meta-device step has none of, so dispatch routes every rank's tokens evenly over the
experts (balanced routing, :func:`autopar.ops.moe.balanced_counts`): the all-to-alls are
compared with the cost model at those counts (``comm_table(expert_counts=...)``), which is
what the model predicts for balanced routing (``routing_imbalance=1``).  Other MoE layouts
are refused with a message.

Run: ``python benchmarks/scale_simulation.py --plan PLAN [--layers L] [--rank R] [--model PRESET]
[--seq S] [--micro-batch B] [--bucket-bytes N]`` (progress is printed as it goes).  The engine (:func:`simulate`,
:func:`compare`) is autopar/verification/scale.py, which tests/e2e/test_scale.py and
tests/e2e/test_search_compiles.py run too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.plan_space import DEFAULT_BUCKET_BYTES  # noqa: E402
from autopar.verification.scale import compare, simulate  # noqa: E402 - the engine, shared with tests/e2e

__all__ = ["simulate", "compare", "main"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="tp=8,sp,dp=16")
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the preset's)")
    ap.add_argument("--rank", type=int, default=0, help="the rank to compile (its pipeline stage)")
    ap.add_argument("--model", default="llama3-70b",
                    help="an autopar.ModelSpec preset (dense, or MoE in every layer: balanced routing)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--micro-batch", dest="microbatch", type=int, default=1)
    ap.add_argument("--bucket-bytes", dest="bucket_bytes", type=int, default=DEFAULT_BUCKET_BYTES,
                    help="the gradient buckets' cap (parallelize's bucket_bytes; the cost model counts the buckets)")
    args = ap.parse_args(argv)
    r = simulate(args.layers, args.plan, args.seq, args.microbatch, rank=args.rank, model=args.model,
                 bucket_bytes=args.bucket_bytes)
    return 0 if compare(r) else 1


if __name__ == "__main__":
    sys.exit(main())
