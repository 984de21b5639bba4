"""Time and peak memory of implied attention maps: full L x L maps and a window of titin.

Cases (a random model of the ESM-2 8M shape, 6 layers x dim 320 x 20 heads; FAVOR+ softmax
unless ``--attention exact``):

* ``full-L``: the full L x L map of one layer (``--layer``, default the last) for ``--heads``
  (default: one head; ``all`` for every head) on a random sequence of length L (1k and 4k);
* ``titin-window``: rows for a 256-residue window of titin (34,350 aa) against all residues.

Each case runs in a fresh subprocess so its peak memory is its own: the peak RSS above the
process's baseline after the model is built (``_common.py``'s sampler; on CUDA the allocator's
peak above its allocation then).
Time includes the forward pass up to the requested layer (the maps need the layer's input).

    python scripts/bench/bench_attention_maps.py          # L = 1024, 4096 and titin[1000:1256]
    python scripts/bench/bench_attention_maps.py --quick  # L = 256, 512, a 2,000-aa titin crop
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _common as common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run, seconds)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="full-map lengths")
    p.add_argument("--window", type=int, nargs=2, default=(1000, 1256), metavar=("START", "END"))
    p.add_argument("--fasta", type=Path, default=common.LONG_PROTEINS, help="long_proteins.fasta")
    p.add_argument("--heads", default="1", help="number of heads per map, or 'all'")
    p.add_argument("--layer", type=int, default=-1, help="layer (1..depth or negative)")
    p.add_argument("--attention", choices=("favor", "exact"), default="favor")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: one case
    return p.parse_args(argv)


def run_case(args: argparse.Namespace) -> None:
    """One measurement, in this process (a fresh one: ``main`` spawns it); emits its result."""
    import numpy as np
    import torch

    from protein_performer.contacts.attention import attention_maps

    torch.set_num_threads(args.threads)
    kind, _, value = args.case.partition(":")
    if kind == "full":
        rng = np.random.default_rng(0)
        seq = "".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), int(value)))
        window = None
    else:
        seq = common.titin(Path(args.fasta))
        if seq is None:
            raise SystemExit(f"error: {args.fasta}: no titin record")
        if value:
            seq = seq[: int(value)]
        start, end = args.window
        end = min(end, len(seq))
        window = (min(start, end - 1), end)
    device = torch.device(args.device)
    model = common.random_lm(attention=args.attention).model.to(device)  # the default shape
    heads = None if args.heads == "all" else list(range(int(args.heads)))
    with common.PeakSampler(None) as sampler:
        peak = common.start_phase(sampler, device)
        t0 = time.perf_counter()
        got = attention_maps(model, seq, layers=[args.layer], heads=heads, window=window)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak_mb = round(peak() / 2**20, 1)
    maps = got.maps[got.layers[0]]
    cuda = device.type == "cuda"
    common.emit({"case": args.case, "length": len(seq), "window": [got.start, got.end],
                 "map_shape": list(maps.shape),
                 "map_mb": maps.numel() * maps.element_size() / 2**20,
                 "seconds": round(seconds, 3), "heads": len(got.heads), "layer": got.layers[0],
                 "attention": args.attention, "device": str(device), "threads": args.threads,
                 "cuda_peak_over_baseline_mb" if cuda else "peak_rss_over_baseline_mb": peak_mb})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        run_case(argparse.Namespace(**json.loads(args.case)))
        return 0
    lengths = args.lengths or ([256, 512] if args.quick else [1024, 4096])
    cases = [f"full:{n}" for n in lengths] + (["titin:2000"] if args.quick else ["titin:"])
    results = []
    for case in cases:
        child = {**vars(args), "fasta": str(args.fasta), "json": None, "case": case}
        got, note = common.spawn_case(__file__, child, timeout=7200)
        if not got:
            print(f"error: {case}: {note}", file=sys.stderr)
            return 1
        res = got[0]
        results.append(res)
        mem = res.get("cuda_peak_over_baseline_mb", res.get("peak_rss_over_baseline_mb"))
        print(f"{case:>12}  L={res['length']:>6}  window={res['window']}  map {res['map_shape']} "
              f"({res['map_mb']:.1f} MB)  {res['seconds']:.2f} s  peak +{mem:.0f} MB",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
