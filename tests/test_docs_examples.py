"""The Python examples of the README and docs/API.md run as written (issue 45: every README and
docs example is executed by a test, not only the README's command lines).

Each ```python block runs, in order, in one namespace per document, in a scratch directory
holding the files the examples name (``emb.h5`` with a ``sp|P69905|HBA_HUMAN`` record,
``contacts.h5``, ``homologs.fasta``, ``runs/c/contact_regression.json``). Only the
placeholders are filled in: a ``pp.load(...)`` of a path the reader would have (``<run>``, a
download) loads a tiny model of the same kind instead, and the free names (``seqs``,
``records``, ``wt``, ...) are bound first. A block that is a signature rather than a call, or
that needs a download, is listed in ``SKIP`` with the reason.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from protein_performer.cli.main import main
from protein_performer.interop.export import export_model
from protein_performer.interop.identity import model_identity
from protein_performer.model.contact_head import ContactRegression
from tests.finetune.test_finetune import base, fitness, lora_run  # noqa: F401 - fixtures
from tests.inference.test_context import FAMILY, tiny_lm
from tests.inference.test_embedding import tiny_loaded
from tests.paths import REPO

pytestmark = pytest.mark.slow  # a fine-tune and a dozen tiny-model runs (about a minute)

SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEV"
#: API.md's wild type: A at 42 and K at 45, for its mutants A42G and A42G:K45R.
WILD_TYPE = SEQ + "QAPILSRVGAGAKDKLSG"
#: Substrings of blocks that are not run, and why.
SKIP = {
    'pp.load("facebook/esm2_t6_8M_UR50D")': "needs ESM-2 weights (a download)",
    "path=\"report.html\", *,": "a signature with its defaults, not a call (test_report runs it)",
}


def blocks(doc: str) -> list[str]:
    text = (REPO / doc).read_text()
    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", text, re.S)]


def with_models(code: str, models: dict[str, Path]) -> str:
    """The block with each ``pp.load("<a reader's path>")`` pointed at a tiny model of that
    kind (a fine-tuned one for ``outputs/finetune/...``, a causal one for ``clm.ckpt``)."""

    def swap(match: re.Match) -> str:
        path = match.group(1)
        kind = "ft" if "finetune" in path else "clm" if "clm" in path else "mlm"
        return f'pp.load("{models[kind]}"'

    return re.sub(r'pp\.load\("([^"]+)"', swap, code)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, lora_run) -> dict:  # noqa: F811 - the imported fixture
    work = tmp_path_factory.mktemp("docs")
    mlm = tiny_loaded("mlm")
    depth, heads = mlm.config.depth, mlm.config.heads
    reg = ContactRegression(np.random.default_rng(0).normal(size=depth * heads), -1.0,
                            list(range(1, depth + 1)), list(range(heads)),
                            **model_identity(mlm))  # fmt: skip
    mlm.contact_regression = reg.to_dict()
    models = {"mlm": export_model(mlm, work / "mlm"), "ft": Path(lora_run["last_checkpoint"]),
              "clm": export_model(tiny_lm().loaded, work / "clm")}  # fmt: skip
    reg.save(work / "runs" / "c" / "contact_regression.json")
    fasta = work / "in.fasta"
    fasta.write_text(f">sp|P69905|HBA_HUMAN Hemoglobin\n{SEQ}\n>b\nMLLAVLYCLAVF\n")
    (work / "homologs.fasta").write_text("".join(f">{i}\n{s}\n" for i, s in FAMILY))
    for out in ("emb.h5", "out.h5"):
        assert main(["embed", str(models["mlm"]), str(fasta), str(work / out), "--include",
                     "mean", "bos", "per_tok", "--repr-layers", "0", "-1", "--no-progress"]) == 0
    assert main(["contacts", "predict", str(models["mlm"]), str(fasta), str(work / "contacts.h5"),
                 "--no-progress"]) == 0  # fmt: skip
    return {"dir": work, "models": models}


def run_blocks(doc: str, scratch: dict, monkeypatch, names: dict) -> int:
    """Run ``doc``'s blocks in order in one namespace; returns how many ran."""
    import protein_performer as pp

    monkeypatch.chdir(scratch["dir"])
    namespace = {"pp": pp, **names}
    ran = 0
    for code in blocks(doc):
        if any(key in code for key in SKIP):
            continue
        if "lm.generate(" in code or "lm.context(" in code:  # causal models' examples
            namespace["lm"] = pp.load(scratch["models"]["clm"], "cpu")
        exec(compile(with_models(code, scratch["models"]), doc, "exec"), namespace)  # noqa: S102
        ran += 1
    return ran


def test_api_md_examples_run(scratch, monkeypatch) -> None:
    import protein_performer as pp

    seqs = [SEQ, "MLLAVLYCLAVF"]
    names = {
        "seqs": seqs, "records": [("a", seqs[0]), ("b", seqs[1])], "seq": WILD_TYPE + SEQ,
        "wild_type": WILD_TYPE, "wt": "MKTLLAVLYCLAVFGSHHWEDNPPQRGSA", "mutants": ["K2R", "T3S"],
        "homologs": [s for _, s in FAMILY],
        "lm": pp.load(scratch["models"]["mlm"], "cpu"),
        "ft": pp.load(scratch["models"]["ft"], "cpu"),
    }  # fmt: skip
    assert run_blocks("docs/API.md", scratch, monkeypatch, names) >= 10


def test_readme_python_example_runs(scratch, monkeypatch) -> None:
    assert run_blocks("README.md", scratch, monkeypatch, {}) == 1
