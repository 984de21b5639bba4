"""Quickstart: the Python API on trained checkpoints (docs/API.md has the whole API).

usage: python examples/quickstart.py MLM_CKPT [CLM_CKPT]

MLM_CKPT is a masked-LM checkpoint (e.g. the one `make demo` trains:
outputs/demo/<run>/checkpoints/last.ckpt); CLM_CKPT, optional, a causal one
(`protein-performer train experiment=demo_clm`) to sample from.
"""

import sys

import protein_performer as pp

seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "MLLAVLYCLAVFALSSCAA"]
lm = pp.load(sys.argv[1], device="auto")  # any .ckpt or exported directory
print(lm)
print("mean embeddings:", lm.embed(seqs).shape)  # (2, dim)
print("per-residue embeddings:", [e.shape for e in lm.embed(seqs, pooling=None)])
print("mean pseudo-log-likelihood per residue:", lm.score(seqs))
print("fill-in:", lm.fill_mask("MKTAYIAK<mask>RQISF", top_k=3))
print("variant effects:", lm.score_variants(seqs[0], ["K2R", "T3S:Q9E"]))
if len(sys.argv) > 2:
    causal = pp.load(sys.argv[2], device="auto")
    for seq in causal.generate(n=3, max_length=60, prompt="M", top_p=0.95, seed=0):
        print(">sample\n" + seq)
