"""Fast checks of torchtitan_ext's pieces: [muon] validation, kwargs mapping, spec registration, CPU patches, data."""

import copy
import json

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.config import ConfigManager
from torchtitan.protocols.train_spec import get_train_spec

import torchtitan_ext
from torchtitan_ext import cpu, data, optimizer, spec
from torchtitan_ext.job_config import Muon as MuonConfig
from torchtitan_ext.job_config import check_optimizer_name

EXT = ["--job.custom_config_module", "torchtitan_ext.job_config"]


def test_muon_section_parses_from_cli_with_defaults_elsewhere():
    config = ConfigManager().parse_args(EXT + ["--muon.ns_steps", "3", "--muon.ns_coefficients", "polar_express"])
    assert config.muon.ns_steps == 3
    assert config.muon.ns_coefficients == "polar_express"
    assert config.muon.momentum == 0.95 and config.muon.adjust_lr_fn == "match_rms_adamw"


def test_muon_section_reads_the_toml_of_a_config(tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text('[job]\ncustom_config_module = "torchtitan_ext.job_config"\n[muon]\nmomentum = 0.9\n')
    config = ConfigManager().parse_args(["--job.config_file", str(toml)])
    assert config.muon.momentum == 0.9


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("exchange", "everyone", "owner, gather_all"),
        ("ns_coefficients", "magic", "cans, polar_express, quintic, simple"),
        ("ns_algorithm", "fast", "auto, standard, gram"),
        ("adjust_lr_fn", "sqrt", "match_rms_adamw, original"),
        ("wire_dtype", "int8", "bfloat16, float32"),
        ("momentum", 1.0, "[0, 1)"),
        ("ns_steps", 0, ">= 1"),
        ("bucket_size_mb", 0.0, "> 0"),
    ],
)
def test_bad_value_lists_the_valid_choices(field, value, needle):
    with pytest.raises(ValueError) as info:
        MuonConfig(**{field: value})
    assert f"[muon] {field}" in str(info.value) and needle in str(info.value)


def test_bf16_wire_with_fp32_newton_schulz_is_refused():
    with pytest.raises(ValueError, match="wire_dtype"):
        MuonConfig(ns_dtype="float32")
    assert MuonConfig(ns_dtype="float32", wire_dtype="float32").ns_dtype == "float32"


def test_unknown_optimizer_name_lists_the_choices():
    with pytest.raises(ValueError, match="Adam, AdamW, Muon"):
        check_optimizer_name("Lion")


def test_muon_kwargs_come_from_both_sections():
    config = ConfigManager().parse_args(EXT + ["--optimizer.lr", "0.01", "--optimizer.beta2", "0.99"])
    kwargs = optimizer.muon_kwargs(config.optimizer, config.muon)
    assert kwargs["lr"] == 0.01 and kwargs["adamw_betas"] == (0.9, 0.99)
    assert kwargs["adamw_eps"] == config.optimizer.eps and kwargs["weight_decay"] == config.optimizer.weight_decay
    assert kwargs["ns_dtype"] is torch.bfloat16 and kwargs["wire_dtype"] is torch.bfloat16
    assert kwargs["overlap"] is False and kwargs["ns_algorithm"] == "auto"
    with_overlap = ConfigManager().parse_args(EXT + ["--muon.overlap"])
    assert optimizer.muon_kwargs(with_overlap.optimizer, with_overlap.muon)["overlap"] is True


def test_specs_are_registered_with_muon_builders():
    assert {"llama3", "deepseek_v3"} <= set(torchtitan_ext.REGISTERED_MODELS)
    assert get_train_spec("llama3").build_optimizers_fn is optimizer.build_optimizers
    moe = get_train_spec("deepseek_v3")
    assert moe.build_optimizers_fn is optimizer.build_optimizers_with_moe_load_balancing
    assert moe.build_metrics_processor_fn is spec.build_metrics_processor


def test_muon_container_routes_named_parameters_and_reports_metrics():
    from torchtitan.config import Optimizer as OptimizerConfig

    model = torch.nn.ModuleDict(
        {"tok_embeddings": torch.nn.Embedding(16, 8), "w": torch.nn.Linear(8, 8), "output": torch.nn.Linear(8, 16)}
    )
    config = OptimizerConfig(name="Muon", lr=0.01)
    container = optimizer.build_optimizers([model], config, parallel_dims=None)
    (muon,) = container.optimizers
    by_kind = {g["use_muon"]: set(g["param_names"]) for g in muon.param_groups}
    assert by_kind[True] == {"w.weight"}
    assert {"tok_embeddings.weight", "output.weight", "w.bias"} <= by_kind[False]
    x = torch.randn(4, 8)
    model["output"](model["w"](x) + model["tok_embeddings"](torch.arange(4))).sum().backward()
    container.step()
    assert "muon/update_rms/muon" in container.metrics
    state = container.state_dict()
    assert any(k.endswith("momentum_buffer") for k in state)


def test_cpu_histc_counts_integers_like_bincount():
    idx = torch.randint(0, 8, (1000,))
    counts = cpu.histc_any_dtype(idx, bins=8, min=0, max=8)
    assert counts.dtype == idx.dtype
    assert torch.equal(counts, torch.bincount(idx, minlength=8))


def test_data_build_reads_sources_and_writes_tokenizer(tmp_path):
    src = tmp_path / "lib"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("def f(x):\n    return x + 1\n" * 300)
    (src / "pkg" / "b.py").write_text("class B:\n    pass\n" * 50)
    (src / "site-packages").mkdir()
    (src / "site-packages" / "c.py").write_text("ignored = True\n")
    out = data.build(tmp_path / "out", vocab_size=300, root=src)
    assert data.is_built(out)
    records = [json.loads(line)["text"] for line in (data.corpus_dir(out) / "stdlib.jsonl").open()]
    assert len(records) > 2  # a.py is cut into pieces
    assert sorted(records) == sorted(
        data.pieces((src / "a.py").read_text()) + data.pieces((src / "pkg" / "b.py").read_text())
    )
    config = json.loads((data.tokenizer_dir(out) / "tokenizer_config.json").read_text())
    assert config["bos_token"] == data.BOS and config["eos_token"] == data.EOS
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_moe_muon_container_keeps_torchtitan_expert_bias_hook():
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing as titan_moe_builder
    from torchtitan.config import Optimizer as OptimizerConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args

    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    args.update_from_config(ConfigManager().parse_args([]))
    model = DeepSeekV3Model(args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    titan = titan_moe_builder([model], OptimizerConfig(name="AdamW", implementation="for-loop"), dims)
    ours = optimizer.build_optimizers_with_moe_load_balancing([model], OptimizerConfig(name="Muon"), dims)
    assert isinstance(ours, optimizer.MuonOptimizersContainer)
    assert len(titan._optimizer_step_pre_hooks) == 1
    assert len(ours._optimizer_step_pre_hooks) == 1
    (muon,) = ours.optimizers
    experts = {n for g in muon.param_groups if g["use_muon"] for n in g["param_names"] if "experts" in n}
    assert experts and all(dict(model.named_parameters())[n].ndim == 3 for n in experts if "shared" not in n)
    adamw = {n for g in muon.param_groups if not g["use_muon"] for n in g["param_names"]}
    assert "tok_embeddings.weight" in adamw and "output.weight" in adamw
