"""Issue 45 #8: words a new user found confusing or stale, checked where they are said."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from protein_performer.cli.main import main
from protein_performer.interop.export import export_model
from protein_performer.training.linearize_options import LinearizeOptions
from tests.inference.test_embedding import tiny_loaded
from tests.paths import REPO


def test_hf_export_warning_says_what_is_random_and_what_to_do(tmp_path, caplog, capsys):
    model = export_model(tiny_loaded("mlm"), tmp_path / "mlm")
    with caplog.at_level(logging.WARNING):
        assert main(["export", str(model), str(tmp_path / "hf"), "--format", "hf",
                     "--as-exact"]) == 0  # fmt: skip
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "no contact regression: none" not in said
    assert "has no contact regression, so the export's esm.contact_head is transformers' " \
        "random initialization" in said and "contacts fit" in said


def test_generate_on_a_masked_model_points_at_the_cpu_demo(tmp_path, capsys):
    model = export_model(tiny_loaded("mlm"), tmp_path / "mlm")
    assert main(["generate", str(model), str(tmp_path / "g.fasta"), "--num", "1",
                 "--max-length", "10"]) == 2
    err = capsys.readouterr().err
    assert "experiment=demo_clm" in err and "small_clm" not in err


def test_api_md_states_the_linearize_defaults() -> None:
    text = (REPO / "docs" / "API.md").read_text()
    options = text[text.index("`options` are the fields of") :].split("\n\n")[0]
    for field in dataclasses.fields(LinearizeOptions):
        found = re.search(rf"`{field.name}` \(([^)]*)\)", options)
        assert found, field.name
        stated = found.group(1).strip('`"')
        assert stated == str(field.default) or float(stated) == pytest.approx(field.default), (
            field.name, stated, field.default)
