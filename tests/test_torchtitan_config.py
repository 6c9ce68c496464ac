"""Fast checks of torchtitan_ext's pieces: the optimizer registry, [muon]/[mop]/[normuon] validation, kwargs mapping,
spec registration, CPU patches, data."""

import copy
import dataclasses
import json

import pytest
import torch

pytest.importorskip("torchtitan")
from torchtitan_ext.version import LINE, VERSION

if LINE != "0.2":
    pytest.skip(f"torchtitan 0.2.x tests; the installed torchtitan is {VERSION}", allow_module_level=True)

from torchtitan.config import ConfigManager
from torchtitan.protocols.train_spec import get_train_spec

import dtensor_muon
import torchtitan_ext
from dtensor_muon.optim.base import GROUP_KEYS_SINCE_CHECKPOINTS
from dtensor_muon.optim.options import OPTIONS
from torchtitan_ext import cpu, data, job_config, optimizer, registry, sections, spec
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
        ("adjust_lr_fn", "sqrt", "original, match_rms_adamw, spectral_unclamped"),
        ("wire_dtype", "int8", "bfloat16, float32"),
        ("momentum", 1.0, "[0, 1)"),
        ("ns_steps", 0, ">= 1"),
        ("bucket_size_mb", 0.0, "> 0"),
        ("tp_mode", "sharded", "owned, duplicated, distributed, auto, blockwise"),
    ],
)
def test_bad_value_lists_the_valid_choices(field, value, needle):
    with pytest.raises(ValueError) as info:
        MuonConfig(**{field: value})
    assert f"[muon] {field}" in str(info.value) and needle in str(info.value)


def test_bf16_wire_with_fp32_newton_schulz_is_refused_and_an_unset_wire_follows_it():
    with pytest.raises(ValueError, match="wire_dtype"):
        MuonConfig(ns_dtype="float32", wire_dtype="bfloat16")
    assert MuonConfig(ns_dtype="float32", wire_dtype="float32").ns_dtype == "float32"
    assert sections.device_dtypes(MuonConfig(ns_dtype="float32"), on_cpu=False) == {"wire_dtype": "float32"}
    assert sections.device_dtypes(MuonConfig(), on_cpu=False) == {"ns_dtype": "bfloat16", "wire_dtype": "bfloat16"}


@pytest.mark.parametrize(
    "name, cli, toml, ns_dtype, wire_dtype",
    [
        ("Muon", [], "", torch.float32, torch.float32),
        ("NorMuon", [], "", torch.float32, torch.float32),
        ("Muon", ["--muon.ns_dtype", "bfloat16", "--muon.wire_dtype", "bfloat16"], "", torch.bfloat16, torch.bfloat16),
        ("Muon", [], '[muon]\nns_dtype = "bfloat16"\nwire_dtype = "bfloat16"\n', torch.bfloat16, torch.bfloat16),
        ("Muon", ["--muon.ns_dtype", "bfloat16"], "", torch.bfloat16, torch.float32),
        ("Muon", ["--muon.wire_dtype", "bfloat16"], "", torch.bfloat16, torch.bfloat16),
    ],
)
def test_a_cpu_job_takes_float32_newton_schulz_and_wire_unless_they_are_set(
    name, cli, toml, ns_dtype, wire_dtype, tmp_path, caplog
):
    """CPUs without AVX-512 BF16 run bfloat16 matrix products many times slower: unset dtypes are float32 there
    (logged); a value from the command line or TOML is kept; on GPUs the unset ones stay bfloat16."""
    config_file = tmp_path / "job.toml"
    config_file.write_text('[job]\ncustom_config_module = "torchtitan_ext.job_config"\n' + toml)
    config = ConfigManager().parse_args(["--job.config_file", str(config_file), "--optimizer.name", name, *cli])
    registry.attach_sections(config)
    with caplog.at_level("INFO"):
        container = optimizer.build_optimizers([_tiny_model(0)], config.optimizer, parallel_dims=None)
    (opt,) = container.optimizers
    assert next(g for g in opt.param_groups if g["use_muon"])["ns_dtype"] is ns_dtype
    assert opt._engine_options["wire_dtype"] is wire_dtype
    section = registry.REGISTRY[name].section
    notes = [r.getMessage() for r in caplog.records if "not set, and this job runs on CPU" in r.getMessage()]
    if not cli and not toml:
        assert notes == [
            f"[{section}] ns_dtype = 'float32', wire_dtype = 'float32': not set, and this job runs on "
            "CPU, where bfloat16 matrix products run many times slower (CPUs without AVX-512 BF16); setting ns_dtype "
            "and wire_dtype keeps your choice"
        ]
        gpu = optimizer.optimizer_kwargs(config.optimizer, on_cpu=False)
        assert (gpu["ns_dtype"], gpu["wire_dtype"]) == (torch.bfloat16, torch.bfloat16)
    elif ns_dtype is wire_dtype:
        assert notes == []


def test_unknown_optimizer_name_lists_the_choices():
    with pytest.raises(ValueError, match="Adam, AdamW, Muon"):
        check_optimizer_name("Lion")


def test_registry_names_are_the_optimizer_choices_and_its_sections_the_config_sections():
    assert registry.OPTIMIZER_NAMES == ("Adam", "AdamW", "Muon", "MOP", "NorMuon", "SOAP", "KLSOAP", "REKLS")
    for name in registry.OPTIMIZER_NAMES:
        check_optimizer_name(name)
    for bad in ("Lion", "muon", "Normuon", ""):
        with pytest.raises(ValueError) as info:
            check_optimizer_name(bad)
        same = {"muon": "Muon", "Normuon": "NorMuon"}.get(bad)
        hint = f" (did you mean {same!r}? names are case-sensitive)" if same else ""
        assert str(info.value) == (
            f"[optimizer] name = {bad!r} is not valid{hint}; choose one of: Adam, AdamW, Muon, MOP, NorMuon, SOAP, "
            "KLSOAP, REKLS"
        )
    assert {name: (e.section, e.section_cls, e.optimizer_cls) for name, e in registry.REGISTRY.items()} == {
        "Muon": ("muon", sections.Muon, dtensor_muon.Muon),
        "MOP": ("mop", sections.MOP, dtensor_muon.MOP),
        "NorMuon": ("normuon", sections.NorMuon, dtensor_muon.NorMuon),
        "SOAP": ("soap", sections.SOAP, dtensor_muon.SOAP),
        "KLSOAP": ("klsoap", sections.KLSOAP, dtensor_muon.KLSOAP),
        "REKLS": ("rekls", sections.REKLS, dtensor_muon.REKLS),
    }
    extension = {f.name: f.type for f in dataclasses.fields(job_config.JobConfig)}
    assert extension == {
        "muon": sections.Muon,
        "mop": sections.MOP,
        "normuon": sections.NorMuon,
        "soap": sections.SOAP,
        "klsoap": sections.KLSOAP,
        "rekls": sections.REKLS,
        "batch_scaling": sections.BatchScaling,
    }
    config = ConfigManager().parse_args(
        EXT + ["--optimizer.name", "NorMuon", "--normuon.beta2", "0.9", "--mop.scale", "shape", "--muon.ns_steps", "3"]
    )
    assert config.optimizer.name == "NorMuon" and config.normuon.beta2 == 0.9 and config.normuon.normuon_eps == 1e-8
    assert config.mop.scale == "shape" and config.muon.ns_steps == 3 and config.normuon.ns_steps == 5


def test_normuon_and_mop_sections_defaults():
    muon, normuon, mop = sections.Muon(), sections.NorMuon(), sections.MOP()
    assert {f.name: getattr(normuon, f.name) for f in dataclasses.fields(muon)} == dataclasses.asdict(muon)
    assert (normuon.beta2, normuon.normuon_eps, normuon.adjust_lr_fn) == (0.95, 1e-8, "match_rms_adamw")
    assert dataclasses.asdict(mop) == {
        "momentum": 0.95, "nesterov": False, "momentum_dtype": "float32", "scale": "nuclear",
        "adjust_lr_fn": "match_rms_adamw",
        "wire_dtype": "float32", "bucket_size_mb": 64.0, "exchange": "owner", "skip_nonfinite": False,
        "diagnostics_interval": 0, "overlap": False, "offload": "none", "tp_mode": "owned", "qk_clip_tau": 0.0,
        "qk_clip_alpha": 0.5,
    }  # fmt: skip


@pytest.mark.parametrize(
    "section_cls, field, value, needle",
    [
        (sections.NorMuon, "beta2", 1.0, "[0, 1)"),
        (sections.NorMuon, "beta2", -0.1, "[0, 1)"),
        (sections.NorMuon, "normuon_eps", 0.0, "> 0"),
        (sections.NorMuon, "ns_coefficients", "magic", "cans, polar_express, quintic, simple"),
        (sections.NorMuon, "exchange", "everyone", "owner, gather_all"),
        (sections.NorMuon, "momentum", 1.0, "[0, 1)"),
        (sections.MOP, "scale", "spectral", "choose one of: nuclear, shape"),
        (sections.MOP, "adjust_lr_fn", "sqrt", "original, match_rms_adamw"),
        (sections.MOP, "wire_dtype", "int8", "choose one of: float32"),
        (sections.MOP, "exchange", "everyone", "owner, gather_all"),
        (sections.MOP, "momentum", -0.5, "[0, 1)"),
        (sections.MOP, "bucket_size_mb", 0.0, "> 0"),
        (sections.MOP, "diagnostics_interval", -1, ">= 0"),
        (sections.SOAP, "shampoo_beta", 1.0, "[0, 1)"),
        (sections.SOAP, "basis", "svd", "choose one of: qr, eigh"),
        (sections.SOAP, "precondition_frequency", 0, "an integer >= 1"),
        (sections.SOAP, "max_preconditioner_dim", 0, "an integer >= 1"),
        (sections.SOAP, "max_update_rms", -1.0, ">= 0"),
        (sections.SOAP, "match_update_rms", -0.2, ">= 0"),
        (sections.SOAP, "wire_dtype", "bfloat16", "SOAP's factors are float32"),
        (sections.KLSOAP, "exchange", "everyone", "owner, gather_all"),
        (sections.REKLS, "bucket_size_mb", 0.0, "> 0"),
    ],
)
def test_bad_section_value_names_its_section_and_the_valid_choices(section_cls, field, value, needle):
    with pytest.raises(ValueError) as info:
        section_cls(**{field: value})
    message = str(info.value)
    assert message.startswith(f"[{section_cls.SECTION}] {field} = {value!r} is not valid") and needle in message


def test_bf16_wire_is_refused_for_mop_from_toml_and_cli(tmp_path):
    with pytest.raises(ValueError) as info:
        sections.MOP(wire_dtype="bfloat16")
    assert str(info.value) == (
        "[mop] wire_dtype = 'bfloat16' is not valid: MOP's SVD runs in float32 and a bfloat16 wire would round "
        "its input; choose one of: float32"
    )
    toml = tmp_path / "x.toml"
    toml.write_text('[job]\ncustom_config_module = "torchtitan_ext.job_config"\n[mop]\nwire_dtype = "bfloat16"\n')
    with pytest.raises(ValueError, match=r"\[mop\] wire_dtype = 'bfloat16' is not valid: MOP's SVD runs in float32"):
        ConfigManager().parse_args(["--job.config_file", str(toml)])
    toml.write_text('[job]\ncustom_config_module = "torchtitan_ext.job_config"\n[normuon]\nbeta2 = 1.5\n')
    with pytest.raises(ValueError, match=r"\[normuon\] beta2 = 1.5 is not valid"):
        ConfigManager().parse_args(["--job.config_file", str(toml)])


def _tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.ModuleDict(
        {"tok_embeddings": torch.nn.Embedding(16, 12), "w": torch.nn.Linear(8, 12), "output": torch.nn.Linear(12, 16)}
    )


def _backward(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(4, 8)
    (model["output"](model["w"](x) + model["tok_embeddings"](torch.arange(4))) ** 2).sum().backward()


@pytest.mark.parametrize(
    "name, cli, expected",
    [
        (
            "MOP",
            ["--mop.scale", "shape", "--mop.adjust_lr_fn", "original", "--mop.momentum", "0.9", "--mop.nesterov",
             "--mop.momentum_dtype", "bfloat16"],
            {"momentum": 0.9, "nesterov": True, "momentum_dtype": "bfloat16", "scale": "shape",
             "adjust_lr_fn": "original", "wire_dtype": torch.float32},
        ),
        (
            "NorMuon",
            ["--normuon.beta2", "0.9", "--normuon.normuon_eps", "1e-6", "--normuon.ns_steps", "4",
             "--normuon.ns_dtype", "float32", "--normuon.wire_dtype", "float32"],
            {"momentum": 0.95, "nesterov": True, "ns_coefficients": "simple", "ns_steps": 4,
             "adjust_lr_fn": "match_rms_adamw", "ns_dtype": torch.float32, "ns_algorithm": "auto",
             "wire_dtype": torch.float32, "ns_cuda_graphs": True, "momentum_dtype": "float32", "beta2": 0.9,
             "normuon_eps": 1e-6},
        ),
        (
            "SOAP",
            ["--soap.shampoo_beta", "0.9", "--soap.precondition_frequency", "2", "--soap.max_preconditioner_dim",
             "10"],
            {"betas": (0.9, 0.99), "eps": 1e-8, "shampoo_beta": 0.9, "precondition_frequency": 2, "basis": "qr",
             "kl": False, "max_preconditioner_dim": 10, "correct_bias": True, "correct_shampoo_beta_bias": True,
             "max_update_rms": 1.0, "match_update_rms": 0.0, "skip_first_update": True, "wire_dtype": torch.float32},
        ),
        (
            "REKLS",
            ["--rekls.max_update_rms", "0.5", "--rekls.no-correct_bias"],
            {"betas": (0.9, 0.99), "eps": 1e-8, "shampoo_beta": 0.95, "precondition_frequency": 1, "basis": "eigh",
             "kl": True, "max_preconditioner_dim": 8192, "correct_bias": False, "correct_shampoo_beta_bias": True,
             "max_update_rms": 0.5, "match_update_rms": 0.0, "skip_first_update": True, "wire_dtype": torch.float32},
        ),
    ],
)  # fmt: skip
def test_container_builds_the_registry_class_and_steps_as_the_class_itself(name, cli, expected):
    args = EXT + ["--optimizer.name", name, "--optimizer.lr", "0.02", "--optimizer.weight_decay", "0.05"]
    config = ConfigManager().parse_args(args + ["--optimizer.beta2", "0.99", *cli])
    registry.attach_sections(config)
    model, reference = _tiny_model(0), _tiny_model(0)
    container = optimizer.build_optimizers([model], config.optimizer, parallel_dims=None)
    assert isinstance(container, optimizer.MatrixOptimizersContainer)
    (opt,) = container.optimizers
    assert type(opt) is registry.REGISTRY[name].optimizer_cls
    engine = {"bucket_size_mb": 64.0, "exchange": "owner", "skip_nonfinite": False, "diagnostics_interval": 0,
              "overlap": False, "offload": "none", "tp_mode": "owned", "qk_clip_tau": 0.0,
              "qk_clip_alpha": 0.5}  # fmt: skip
    kwargs = {"lr": 0.02, "weight_decay": 0.05, "adamw_betas": (0.9, 0.99), "adamw_eps": 1e-8, **engine, **expected}
    assert optimizer.optimizer_kwargs(config.optimizer) == kwargs
    matrices = next(g for g in opt.param_groups if g["use_muon"])
    assert matrices["param_names"] == ["w.weight"] and matrices["lr"] == 0.02 and matrices["weight_decay"] == 0.05
    assert matrices["adamw_betas"] == (0.9, 0.99)
    for key in set(expected) - {o.name for o in OPTIONS[name] if o.engine}:  # the param-group keys
        assert matrices.get(key, GROUP_KEYS_SINCE_CHECKPOINTS.get(key)) == expected[key], key  # absent: old value
    direct = getattr(dtensor_muon, name)(list(reference.named_parameters()), **kwargs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):  # the second step reads the state of the first (momentum, NorMuon's second moment)
        for m, opt_ in ((model, container), (reference, direct)):
            opt_.zero_grad()
            _backward(m, seed=1)
            opt_.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert not torch.equal(p, before[n]), n
        assert torch.equal(p, q), n
    assert f"muon/update_rms/{direct.rule.name}" in container.metrics


@pytest.mark.parametrize("name", ["MOP", "NorMuon", "KLSOAP"])
def test_sections_default_where_none_is_attached(name):
    from torchtitan.config import Optimizer as OptimizerConfig

    entry = registry.REGISTRY[name]
    config = OptimizerConfig(name=name, lr=0.01)
    assert optimizer.optimizer_kwargs(config) == entry.kwargs(config, entry.section_cls())
    container = optimizer.build_optimizers([_tiny_model(0)], config, parallel_dims=None)
    (opt,) = container.optimizers
    assert type(opt) is entry.optimizer_cls
    group = opt.param_groups[0]
    if name == "MOP":
        assert group["scale"] == "nuclear" and group["nesterov"] is False
    elif name == "NorMuon":
        assert group["beta2"] == 0.95 and group["normuon_eps"] == 1e-8
    else:
        assert group["kl"] is True and group["basis"] == "qr" and group["shampoo_beta"] == 0.95


def test_muon_kwargs_come_from_both_sections():
    config = ConfigManager().parse_args(EXT + ["--optimizer.lr", "0.01", "--optimizer.beta2", "0.99"])
    kwargs = optimizer.optimizer_section_kwargs("Muon", config.optimizer, config.muon)
    assert kwargs["lr"] == 0.01 and kwargs["adamw_betas"] == (0.9, 0.99)
    assert kwargs["adamw_eps"] == config.optimizer.eps and kwargs["weight_decay"] == config.optimizer.weight_decay
    assert kwargs["ns_dtype"] is torch.bfloat16 and kwargs["wire_dtype"] is torch.bfloat16
    assert kwargs["overlap"] is False and kwargs["ns_algorithm"] == "auto"
    with_overlap = ConfigManager().parse_args(EXT + ["--muon.overlap"])
    assert optimizer.optimizer_section_kwargs("Muon", with_overlap.optimizer, with_overlap.muon)["overlap"] is True
    assert kwargs["offload"] == "none"
    offloaded = ConfigManager().parse_args(EXT + ["--muon.offload", "host"])
    assert optimizer.optimizer_section_kwargs("Muon", offloaded.optimizer, offloaded.muon)["offload"] == "host"
    assert kwargs["tp_mode"] == "owned"
    distributed = ConfigManager().parse_args(EXT + ["--muon.tp_mode", "distributed"])
    assert (
        optimizer.optimizer_section_kwargs("Muon", distributed.optimizer, distributed.muon)["tp_mode"] == "distributed"
    )


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
    assert isinstance(ours, optimizer.MatrixOptimizersContainer)
    assert len(titan._optimizer_step_pre_hooks) == 1
    assert len(ours._optimizer_step_pre_hooks) == 1
    (muon,) = ours.optimizers
    experts = {n for g in muon.param_groups if g["use_muon"] for n in g["param_names"] if "experts" in n}
    assert experts and all(dict(model.named_parameters())[n].ndim == 3 for n in experts if "shared" not in n)
    adamw = {n for g in muon.param_groups if not g["use_muon"] for n in g["param_names"]}
    assert "tok_embeddings.weight" in adamw and "output.weight" in adamw
