"""Files from strangers: crafted model configs, HF configs and pickles each give one ``error:``
line and exit 2, with no traceback and no large allocation (peak RSS near the idle process's).

The corpus runs in one child process (``python tests/test_crafted_inputs.py OUT``), so its peak
RSS is measured from a known baseline rather than after whatever the test session allocated.
"""

from __future__ import annotations

import copy
import io
import json
import os
import resource
import shutil
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import torch

from tests.paths import REPO

PEAK_GROWTH_MB = 150  # a tiny model's load is ~1 MB; one crafted allocation would be GBs


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model_configs(base: dict) -> dict[str, object]:
    """Name -> the ``config`` entry of an export's config.json (or a whole-file edit)."""
    cfg = base["config"]
    edits = {
        "depth_200000": {"depth": 200000},
        "dim_1e9_float": {"dim": 1e9},
        "dim_1e9_int": {"dim": 10**9},
        "dim_heads_huge": {"dim": 10**6, "heads": 10**5},
        "vocab_huge": {"vocab_size": 10**12},
        "nb_features_huge": {"nb_features": 10**12},
        "ff_dim_huge": {"ff_dim": 10**11},
        "dropout_string": {"dropout": "0.1"},
        "dropout_1": {"dropout": 1.0},
        "token_dropout_no": {"token_dropout": "no"},
        "token_dropout_int": {"token_dropout": 1},
        "checkpointing_string": {"gradient_checkpointing": "false"},
        "layer_norm_eps_null": {"layer_norm_eps": None},
        "layer_norm_eps_string": {"layer_norm_eps": "1e-5"},
        "layer_norm_eps_negative": {"layer_norm_eps": -1.0},
        "rotary_base_zero": {"rotary_base": 0},
        "rotary_base_1e308": {"rotary_base": 1e308},
        "layer_norm_eps_1e308": {"layer_norm_eps": 1e308},
        "chunk_1e9": {"favor_chunk_size": 10**9},
        "heads_zero": {"heads": 0},
        "heads_negative": {"heads": -4},
        "heads_not_dividing": {"heads": 3},
        "heads_bool": {"heads": True},
        "depth_float": {"depth": 2.0},
        "depth_string": {"depth": "2"},
        "depth_other": {"depth": 3},  # fits nothing in model.safetensors
        "dim_other": {"dim": 64},
        "pad_idx_outside": {"pad_idx": 99},
        "objective_unknown": {"objective": "gpt"},
        "attention_int": {"attention": 5},
        "kernel_null": {"kernel": None},
        "redraw_negative": {"feature_redraw_interval": -1},
        "chunk_zero": {"favor_chunk_size": 0},
        "unknown_key": {"n_layers": 4},
    }
    out: dict[str, object] = {}
    for name, edit in edits.items():
        meta = copy.deepcopy(base)
        meta["config"] = {**cfg, **edit}
        out[name] = meta
    whole = {
        "config_list": {**base, "config": [1, 2]},
        "config_null": {**base, "config": None},
        "no_format_version": {k: v for k, v in base.items() if k != "format_version"},
        "format_version_string": {**base, "format_version": "1"},
        "format_version_future": {**base, "format_version": 99},
        "foreign_format": {**base, "format": "something.else"},
        "vocab_int": {**base, "vocab": 7},
        "json_list": [base],
    }
    out.update(whole)
    return out


def _hf_configs() -> dict[str, object]:
    good = {
        "model_type": "esm", "position_embedding_type": "rotary", "hidden_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
        "vocab_size": 33, "token_dropout": True, "layer_norm_eps": 1e-5,
    }  # fmt: skip
    return {
        "hf_list": [good],
        "hf_string_number": {**good, "hidden_size": "32"},
        "hf_heads_string": {**good, "num_attention_heads": "2"},
        "hf_token_dropout_no": {**good, "token_dropout": "no"},
        "hf_eps_string": {**good, "layer_norm_eps": "x"},
        "hf_rope_negative": {**good, "rope_theta": -1},
        "hf_null_model_type": {**good, "model_type": None},
    }


def child(out: Path) -> None:
    """Build the corpus, run every case through the CLI in this process, report as JSON."""
    from safetensors.torch import save_file

    from protein_performer.cli.main import main
    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.interop.export import export_model
    from protein_performer.interop.record import LoadedModel
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    config = PerformerConfig(dim=32, depth=2, heads=2, ff_dim=64, nb_features=8)
    model = PerformerLM(config)
    cpu = torch.device("cpu")
    good = export_model(LoadedModel(model, config, Alphabet(), out, cpu, "export"), out / "good")
    fasta = out / "x.fasta"
    fasta.write_text(">a\nMKVLA\n")
    base = json.loads((good / "config.json").read_text())
    cases: list[tuple[str, list[str]]] = []
    for name, meta in _model_configs(base).items():
        d = out / name
        shutil.copytree(good, d)
        (d / "config.json").write_text(json.dumps(meta))
        cases.append((name, ["embed", str(d), str(fasta), str(out / f"{name}.h5")]))
    for name, hf in _hf_configs().items():
        d = out / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf))
        save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
        cases.append((name, ["convert-esm", str(d), str(out / f"{name}_out")]))
    damaged = out / "truncated_weights"
    shutil.copytree(good, damaged)
    blob = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    cases.append(("truncated_weights", ["embed", str(damaged), str(fasta), str(out / "t.h5")]))
    huge_header = out / "huge_header"
    shutil.copytree(good, huge_header)
    (huge_header / "model.safetensors").write_bytes((10**15).to_bytes(8, "little") + b"{}")
    cases.append(("huge_header", ["embed", str(huge_header), str(fasta), str(out / "h.h5")]))
    marker = out / "pwned"
    evil = out / "evil.ckpt"
    torch.save({"state_dict": {}, "x": _Payload(str(marker))}, evil)
    evil_pt = out / "evil.pt"
    torch.save({"model": {}, "cfg": _Payload(str(marker))}, evil_pt)
    for env in ("", "1"):
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = env
        tag = "with_env" if env else "no_env"
        cases += [
            (f"pickle_embed_{tag}", ["embed", str(evil), str(fasta), str(out / f"e{tag}.h5")]),
            (f"pickle_score_{tag}", ["score", str(evil), str(fasta), str(out / f"s{tag}.csv")]),
            (f"pickle_export_{tag}", ["export", str(evil), str(out / f"x{tag}")]),
            (f"pickle_esm_{tag}", ["convert-esm", str(evil_pt), str(out / f"c{tag}")]),
        ]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = []
    for name, argv in cases:
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1" if "with_env" in name else ""
        err = io.StringIO()
        with redirect_stderr(err):
            try:
                rc = main(argv)
            except BaseException as exc:  # noqa: BLE001 - the report says what escaped
                rc = f"{type(exc).__name__}: {exc}"
        results.append({"case": name, "rc": rc, "stderr": err.getvalue()})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = {
        "results": results,
        "baseline_kb": baseline,
        "peak_kb": peak,
        "payload_ran": marker.exists(),
    }
    print(json.dumps(report))


def test_crafted_inputs_give_one_line_and_allocate_nothing(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results = report["results"]
    assert len([r for r in results if not r["case"].startswith(("hf_", "pickle_"))]) >= 30
    bad = []
    for r in results:
        lines = [line for line in r["stderr"].splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        if r["rc"] != 2 or len(errors) != 1 or "Traceback" in r["stderr"]:
            bad.append(r)
    assert not bad, json.dumps(bad, indent=1)[:4000]
    assert not report["payload_ran"]
    for r in results:
        if r["case"].startswith("pickle_"):
            assert "other than tensors; refusing to load" in r["stderr"], r
    growth_mb = (report["peak_kb"] - report["baseline_kb"]) / 1024
    assert growth_mb < PEAK_GROWTH_MB, f"peak RSS grew by {growth_mb:.0f} MB"


if __name__ == "__main__":
    child(Path(sys.argv[1]))
