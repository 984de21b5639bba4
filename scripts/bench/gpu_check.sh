#!/usr/bin/env bash
# FAVOR+ against SDPA (flash on CUDA) in bf16 on one machine (sized for under 10 minutes; not
# yet timed on a GPU since the Triton kernels, whose first compile adds to it): the attention
# core (causal and bidirectional, L = 4k..64k; causal both as `ours`, on CUDA the Triton kernel,
# and as `ours-torch`, the torch chunked scan), embedding (300 real proteins and long
# sequences; our exact twin and transformers' EsmModel) and training steps (FAVOR+ vs the exact
# twin), then one ratio table (scripts/bench/ratio_table.py). Outputs under --out.
#
#   scripts/bench/gpu_check.sh                          # on a CUDA machine
#   scripts/bench/gpu_check.sh --device cpu --quick     # tiny sizes in seconds (what the tests run)
#
# Options: --device cuda|cpu (default cuda), --quick, --out DIR (default .bench/gpu_check).
# PYTHON picks the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/../.."
device=cuda
quick=0
out=.bench/gpu_check
py=${PYTHON:-python}
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device=${2:?--device needs cuda or cpu}; shift 2 ;;
        --quick) quick=1; shift ;;
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
if [ "$quick" = 1 ]; then
    attention=(--lengths 128 --repeats 1 --budget-s 1 --matmul-n 256 --timeout 120)
    embed=(--lengths 128 --proteins 4 --timeout 120)
    train=(--quick --lengths 64 --steps 1)
else
    attention=(--lengths 4096,16384,65536 --timeout 120)
    embed=(--lengths 2048 8192 16384 --proteins 300 --repeats 3 --timeout 120)
    train=(--lengths 1024,4096 --tokens 16384 --steps 5 --budget-s 10 --timeout 120)
fi
"$py" scripts/bench/bench_attention.py --device "$device" --dtype bfloat16 --impls ours,ours-torch,sdpa \
    --modes causal,bidirectional "${attention[@]}" --out "$out/attention"
"$py" scripts/bench/bench_embed.py --device "$device" --dtype bfloat16 --impls performer exact hf \
    --no-titin "${embed[@]}" --out "$out/embed.csv"
"$py" scripts/bench/bench_train.py --device "$device" --precision bf16-mixed --attentions favor,exact \
    --objectives mlm,clm "${train[@]}" --out "$out/train"
"$py" scripts/bench/ratio_table.py "$out"
