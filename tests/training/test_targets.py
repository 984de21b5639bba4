"""Configs build only what their group is for (issue 42 #2): a ``_target_`` outside its group's
allowlist is one error line naming the key, before anything is instantiated."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from protein_performer.cli.main import main
from protein_performer.errors import UserError
from protein_performer.training.compose import compose_config, conf_dir
from protein_performer.training.targets import check_override_targets


def test_an_override_that_would_open_a_file_writes_nothing(tmp_path: Path, capsys) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    argv = ["train", "experiment=demo_clm", "+callbacks.evil._target_=builtins.open",
            f"+callbacks.evil._args_=[{victim},w]", f"paths.root_dir={tmp_path}"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "callbacks.evil._target_=builtins.open" in lines[0]
    assert "Traceback" not in err
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "outputs").exists()


def test_a_shared_experiment_yaml_cannot_write_a_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    script = tmp_path / "run.sh"
    (conf / "experiment" / "shared.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - demo_clm\n"
        "logger:\n  evil:\n    _target_: pathlib.Path.write_text\n"
        f"    _args_: ['{script}', 'echo pwned']\n"
    )
    monkeypatch.setenv("PROTEIN_PERFORMER_CONF_DIR", str(conf))
    with pytest.raises(UserError, match=r"logger\.evil\._target_=pathlib\.Path\.write_text"):
        compose_config(["experiment=shared"])
    assert not script.exists()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("+hydra.callbacks.x._target_=builtins.exec", "hydra.callbacks.x._target_"),
        ("+evil._target_=builtins.open", "evil._target_"),
        ("+model.x._target_=os.remove", "model.x._target_"),
        ("+hydra.job_logging.handlers.x.class=logging.config.fileConfig", "handlers.x.class"),
    ],
)
def test_each_group_refuses_what_it_is_not_for(override: str, key: str) -> None:
    with pytest.raises(UserError, match=r"config key .*" + re.escape(key)):
        compose_config(["experiment=demo_clm", override])


def test_the_shipped_configs_pass() -> None:
    for overrides in (["experiment=demo"], ["trainer=fsdp", "logger=wandb"], ["trainer=ddp"]):
        compose_config(overrides)
    compose_config(["base=x", "data.train=y"], name="finetune")


def test_a_class_loaded_by_path_is_checked_too() -> None:
    with pytest.raises(UserError, match="may only load protein_performer"):
        key = "trainer.strategy.auto_wrap_policy.module_classes.0.path"
        compose_config(["trainer=fsdp", f"{key}=antigravity.x"])


def test_sweep_overrides_are_checked_as_given() -> None:
    with pytest.raises(UserError, match="hydra.callbacks.x._target_"):
        check_override_targets(["-m", "seed=1,2", "+hydra.callbacks.x._target_=builtins.open"])
    check_override_targets(["-m", "callbacks.lr_monitor._target_="
                            "pytorch_lightning.callbacks.LearningRateMonitor"])  # fmt: skip
