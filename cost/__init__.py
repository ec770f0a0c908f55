"""autopar.cost: the symbolic cost model -- time, memory and communication of a parallel plan.

Public API: ``ModelSpec`` (spec.py), ``Cluster`` (hardware.py), ``estimate`` -> ``Cost``
(estimate.py) with ``breakdown()`` -> [``Term``] and ``comm_table()`` -> [``CommRow``]
(comm.py). Plan search is ``autopar.search`` (autopar/planning/search.py). docs/cost-model.md
has the full account and the calibration table.

The modules: ``spec`` (``ModelSpec``: the model's dimensions), ``hardware`` (``Cluster``: GPU
presets, links, which axes cross nodes), ``symbols`` (the sympy symbols), ``comm`` (bytes per
collective), ``flops`` (FLOPs by GEMM class), ``memory`` (memory per GPU), ``time`` (compute
and collective time, overlap, the step), ``pipeline`` (layer placement, micro-batches in
flight, the bubble), ``estimate`` (``estimate`` and ``Cost``: one plan), ``model`` (every
formula lambdified once and evaluated on arrays of plans), ``cache`` (the lambdified
formulas on disk), ``calibration`` (the fitted constants against published runs), ``profile``
(a machine's figures measured by ``autopar calibrate``, read by ``Cluster.from_profile``).

The model, as formulas (symbols in symbols.py; T = b*S/cp tokens of a micro-batch on a
rank, T_sp = T/tp under SP; l_d, l_e dense / MoE layers on the rank):

  bytes per collective          ring convention of docs/architecture.md       comm.row_specs
    TP   all-reduce 2(tp-1)/tp * b*S/cp*H*w, 2 l_d + l_e + 1 per micro-batch each way
    SP   all-gather (tp-1)*A/tp and reduce-scatter (tp-1)/tp*A, duals in backward,
         + per step 2(tp-1)/tp * norm-gradient bytes
    CP   ring 2T(g/tp)d*w x (cp-1) per layer (fwd), x2 in bwd; all-gather K,V /
         reduce-scatter dK,dV; Ulysses all-to-all of q,k,v and of the output
    EP   all-to-all n_out*H*w / n_in*H*w, dispatch + combine, fwd and bwd, with
         n_out = n_in = (ep-1)/ep * (T/tp)*k*rho (search) or the recorded counts
         (comm.routed_all_to_all_rows); + (ep-1)/ep * E*8 counts exchange
    PP   T*H*w*(1 - sp + sp/tp) per boundary send
    DP   2(n-1)/n * P*w_gc (ZeRO 0) or (n-1)/n * P*w_gc (ZeRO >= 1) + ZeRO gathers
  FLOPs                         2*T*(params touched) + 2*b*S^2*a*d/(tp*cp)  flops.gemm_classes
  memory                        P*(w_p or w_z, w_g, w_o) / n under ZeRO      memory.memory_terms
                                + n_inflight * sum of per-layer activations  activations.derived_layer_bytes
  peak memory                   static + max(backward phase, sync phase)     memory.peak_memory
  compute time                  F / (P_peak * eta_max * n/(n + kappa*1.5*w*P_peak/B_hbm))
                                + element-wise bytes / B_hbm                time.compute_terms
  collective time               sent * beta_axis + passes * alpha_axis      time.row_time, hardware.axis_link_arrays
  exposed                       max((1 - phi) t, t - overlap window)        time.exposure
  step                          m (T_f + T_b) + bubble + per-step comm + optimizer
                                bubble per schedule                          pipeline.bubble_expr
  derived                       tokens/s = B*S/step; MFU = model FLOPs / (step * GPUs * P_peak)

model.py lambdifies all of it once (the generated code cached on disk, cache.py) and evaluates it
over arrays of plans; calibration.py fits eta_max, kappa, epsilon and phi to calibration.md.
"""
from .comm import CommRow
from .estimate import Cost, Term, estimate
from .hardware import Cluster
from .spec import ModelSpec

__all__ = ["ModelSpec", "Cluster", "Cost", "CommRow", "Term", "estimate"]
