"""FAVOR+ attention, one file per role (flash-linear-attention's ``fla/ops/<op>/`` layout).

Math: docs/FAVOR.md (Choromanski et al., ICLR 2021) and, for ``softmax_opt``, FAVOR++
(Likhosherstov et al., "Chefs' Random Tables", NeurIPS 2022).

- :mod:`.kernels`: random matrices, the FAVOR++ statistic and :class:`FeatureMap`, phi with its
  stabilizers and gradients, written once: one subclass per kernel, registered by name in
  :data:`FEATURE_MAPS` (a new kernel is a new class);
- :mod:`.reference`: phi(Q) phi(K)^T masked and normalized with plain autograd (quadratic
  memory): the spec every fused path is tested against;
- :mod:`.bidirectional` and :mod:`.causal`: the fused paths, linear in L in time and memory, each
  one autograd node that recomputes the features in backward; the causal one drives the chunked
  scan of :mod:`.scan`, whose tile sizes :mod:`.tiles` tunes per machine; on CUDA the Triton
  kernels of :mod:`.triton_causal` (feature map and stabilizer fused into the scan) run instead;
- :mod:`.maps`: implied attention maps (the rows FAVOR+ uses without forming them);
- :mod:`.module`: :func:`favor_attention` (dispatch) and :class:`FavorAttention`, which owns
  omega and the RNN step.

Conventions: q, k, v are (B, H, L, d) and *unscaled*: the kernel approximates
softmax(q k^T / sqrt(d)); the temperature t = d^-1/4 is folded into the projection (no scaled
copy of q or k is made). ``key_padding_mask`` is (B, L) bool, True = pad; padded keys get zero
features, so they add nothing to the numerator or the normalizer. Features are computed in
float32 (float64 when the inputs are float64), also under bf16/fp16 autocast; the output is cast
back to q's dtype. Feature dimension M: m (= nb_features) for softmax, softmax_opt and relu; 2m
for softmax_hyp and trig (each omega row gives a +/- or sin/cos pair).
"""

from protein_performer.model.favor.kernels import (
    FEATURE_MAPS,
    KERNELS,
    FeatureMap,
    draw_omega,
    kernel_class,
    oprf_coefficients,
    oprf_rho,
    random_features,
)
from protein_performer.model.favor.maps import MapFactors, MapStabilizers, favor_attention_map
from protein_performer.model.favor.module import FavorAttention, FavorState, favor_attention
from protein_performer.model.favor.reference import favor_attention_reference

__all__ = [
    "FEATURE_MAPS",
    "KERNELS",
    "FavorAttention",
    "FavorState",
    "FeatureMap",
    "MapFactors",
    "MapStabilizers",
    "draw_omega",
    "favor_attention",
    "favor_attention_map",
    "favor_attention_reference",
    "kernel_class",
    "oprf_coefficients",
    "oprf_rho",
    "random_features",
]
