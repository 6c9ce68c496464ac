"""What a first user of the torchtitan 0.2 launcher meets before any training: a misspelled TOML key or an
optimizer name in the wrong case stops the job at once, with one line from rank 0 and no traceback."""

import sys

import pytest

pytest.importorskip("torchtitan")
from torchtitan_ext.version import LINE

if LINE != "0.2":
    pytest.skip("torchtitan 0.2.x launcher", allow_module_level=True)

from torchtitan_ext import job_config, train

MISSPELLED = '[job]\ncustom_config_module = "torchtitan_ext.job_config"\n[muon]\nns_step = 3\n'


def test_config_problem_names_the_key_and_the_case_of_the_name(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text(MISSPELLED)
    problem = train.config_problem(["--job.config_file", str(toml)])
    assert problem is not None and problem.startswith("[muon] has no key 'ns_step' (did you mean 'ns_steps'?)")
    problem = train.config_problem(["--optimizer.name", "muon"])
    assert problem is not None and "[optimizer] name = 'muon' is not valid (did you mean 'Muon'?" in problem
    assert train.config_problem(["--optimizer.name", "NorMuon"]) is None


@pytest.mark.parametrize("rank", ["0", "1"])
def test_launcher_stops_before_building_anything_with_one_line_from_rank_0(tmp_path, monkeypatch, capsys, rank):
    """``main()`` as torchrun starts it on rank 0 and on rank 1: exit status 2 (SystemExit, no traceback), rank
    0 prints one line, rank 1 nothing; nothing is built (no data folder appears in the working directory)."""
    toml = tmp_path / "bad.toml"
    toml.write_text(MISSPELLED)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(sys, "argv", ["train", "--job.config_file", str(toml), "--optimizer.name", "muon"])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if "HF assets path" not in line]
    if rank == "0":
        assert len(lines) == 1 and lines[0].startswith("torchtitan_ext.train: [muon] has no key 'ns_step'")
    else:
        assert lines == []
    assert not (tmp_path / "data").exists()


def test_check_config_only_checks_and_names_what_the_job_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["--optimizer.name", "AdamW", "--model.name", "llama3", "--model.flavor", "debugmodel"]
    monkeypatch.setattr(sys, "argv", ["train", "--check-config", *args, "--training.steps", "7"])
    train.main()  # returns: nothing built, no trainer
    assert "llama3 debugmodel + AdamW (lr " in capsys.readouterr().out and "7 steps" in job_config.describe(
        train.parse([*args, "--training.steps", "7"])
    )
    assert not (tmp_path / "data").exists()


def test_mop_with_the_nuclear_scale_says_what_its_lr_means():
    from torchtitan_ext.optimizer import setting_hint

    hint = setting_hint("MOP", {"lr": 0.01, "scale": "nuclear"})
    assert hint is not None and "--mop.scale shape" in hint and "lr = 0.01" in hint
    assert setting_hint("MOP", {"lr": 0.01, "scale": "shape"}) is None
    assert setting_hint("Muon", {"lr": 0.01}) is None


def test_demo_configs_set_every_optimizer_section_alike():
    """--optimizer.name X on a demo config runs X with the demo's CPU choices: float32 Newton–Schulz and wire
    where X has them, the same diagnostics interval, MOP on Muon's lr scale."""
    from torchtitan.config import ConfigManager

    job_config.use_in_config_manager()
    for path in ("train_configs/llama3_tiny.toml", "train_configs/moe_tiny.toml"):
        config = ConfigManager().parse_args(["--job.config_file", path])
        for section in ("muon", "normuon"):
            assert (getattr(config, section).ns_dtype, getattr(config, section).wire_dtype) == ("float32", "float32")
        for section in ("muon", "normuon", "mop", "soap", "klsoap", "rekls"):
            assert getattr(config, section).diagnostics_interval == 50, (path, section)
        assert config.mop.scale == "shape"
