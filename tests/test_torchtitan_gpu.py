"""torchtitan 0.2.x on one GPU with the cut-down flavors of real models (:mod:`torchtitan_ext.flavors`) and their
configs (``train_configs/*_2layers_gpu.toml``).

CPU tests (fast, no GPU): the flavors are registered with the real flavors' dimensions and only ``n_layers``
changed, their models hold the real model's first two layers, each config and the GPU tests' overrides pass the
launcher's configuration check, and torchtitan's line is found without its package metadata.

GPU tests (``e2e``; skipped with "needs a CUDA GPU" where CUDA is unavailable): for each flavor, with Muon and with
SOAP, one process (``torchrun --nproc_per_node 1 -m torchtitan_ext.train``) trains :data:`STEPS` steps of
:data:`GPU_TOKENS` with a checkpoint at step :data:`SAVE_AT`; a second process resumes from that checkpoint. The
resumed losses must equal the uninterrupted run's at every step after the checkpoint, exactly: in the log (five
decimals) and, where TensorBoard is installed, the float32 scalars of the run's events. Both runs use torchtitan's
``--debug.deterministic`` (``torch.use_deterministic_algorithms(True)``, a fixed cuBLAS workspace), as its own
bitwise loss comparisons do: the first resumed step is a forward pass of the restored weights on the restored batch,
and each later one depends on the restored optimizer state (momentum, SOAP's factors and bases, step counts), the
lr schedule and the data position, so any of them restored wrongly changes the loss. Each run must also print the
optimizer line and the FLOPs/MFU line at every step.

Each GPU test writes checkpoints of 13-30 GB under pytest's temporary folder (``--basetemp`` moves it) and removes
it at the end; it is skipped where the folder's disk has less room (:data:`CHECKPOINT_GB`).
"""

import copy
import dataclasses
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from titan_runs import failure, torchrun

pytest.importorskip("torchtitan")
from torchtitan_ext.version import LINE, VERSION

if LINE != "0.2":
    pytest.skip(f"torchtitan 0.2.x tests; the installed torchtitan is {VERSION}", allow_module_level=True)

import torchtitan_ext
from torchtitan_ext import flavors, train

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "llama3": "llama3_8b_2layers_gpu.toml",
    "qwen3": "qwen3_30b_a3b_2layers_gpu.toml",
    "deepseek_v3": "deepseek_v3_16b_2layers_gpu.toml",
}
"""The one-GPU config of each cut-down flavor."""

FLAVORS = {
    "llama3": ("8B", "8B_2layers"),
    "qwen3": ("30B-A3B", "30B-A3B_2layers"),
    "deepseek_v3": ("16B", "16B_2layers"),
}
"""model: (real flavor, cut-down flavor)."""

STEPS, SAVE_AT = 4, 2
GPU_TOKENS = (2, 1024)
"""Local batch × sequence length of the GPU tests (the configs train 16,384 tokens a step)."""

GPU_RUN = [
    "--training.steps", str(STEPS), "--training.local_batch_size", str(GPU_TOKENS[0]),
    "--training.seq_len", str(GPU_TOKENS[1]), "--lr_scheduler.warmup_steps", str(STEPS), "--metrics.log_freq", "1",
    "--metrics.disable_color_printing", "--muon.diagnostics_interval", "2", "--soap.diagnostics_interval", "2",
    "--checkpoint.enable", "--checkpoint.interval", str(SAVE_AT), "--checkpoint.last_save_model_only",
    "--checkpoint.export_dtype", "bfloat16", "--debug.deterministic", "--debug.seed", "0",
]  # fmt: skip
"""Overrides of every GPU run: few short steps, a full checkpoint at step SAVE_AT (the last save is the weights
only, in bf16), deterministic algorithms. The learning rate warms up over all STEPS steps: with a warm-up of 2
at the configs' lr 3e-4, the Llama3 flavor's loss rises at steps 2-3 under AdamW itself (12.23, 12.31, 13.11)
and under SOAP (12.23, 12.20, 12.25, 12.53), and falls at every step with the warm-up over 4 steps."""

OPTIMIZERS = {
    "Muon": ["--optimizer.name", "Muon"],
    # a basis refresh on steps 1 (eigh) and 3 (power iteration + QR, the first step after the resume)
    "SOAP": ["--optimizer.name", "SOAP", "--soap.precondition_frequency", "2"],
}
SOAP_EXTRA = {"qwen3": ["--soap.max_preconditioner_dim", "1024"]}
"""Qwen3's 768 expert matrices keep SOAP state of 40 GB (a 53 GB checkpoint) with both sides preconditioned; the
GPU test preconditions their 768 side only (14 GB, 26 GB checkpoint)."""

RESUME = ["--checkpoint.load_step", str(SAVE_AT), "--checkpoint.load_only", "--metrics.save_tb_folder", "tb_resumed"]
"""Overrides of the resumed run: load step SAVE_AT's checkpoint, save none, TensorBoard events in a folder of
their own."""

CHECKPOINT_GB = {
    ("llama3", "Muon"): 19,
    ("llama3", "SOAP"): 23,
    ("qwen3", "Muon"): 21,
    ("qwen3", "SOAP"): 30,
    ("deepseek_v3", "Muon"): 13,
    ("deepseek_v3", "SOAP"): 26,
}
"""Disk each GPU test writes (GB): the full checkpoint at step SAVE_AT (fp32 weights, optimizer state) and the bf16
weights of the last step, estimated from the parameter and state counts."""

OPTIMIZER_LINE = re.compile(r"optimizer: (update_rms .*)?skipped 0  time \S+ms  exchange \S+")
FLOPS_LINE = re.compile(
    r"flops: model \S+ TFLOP/s, optimizer \S+ TFLOP/step \(\+\S+% of the model's\), both \S+ TFLOP/s per device"
    r"  mfu: \S+% model only, \S+% with optimizer"
)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_args(model: str, optimizer: str) -> list[str]:
    """The overrides of a GPU test's uninterrupted run."""
    return [*GPU_RUN, *OPTIMIZERS[optimizer], *(SOAP_EXTRA.get(model, []) if optimizer == "SOAP" else [])]


def tensorboard_args() -> list[str]:
    """Nothing where TensorBoard is installed (the configs write events); else switch it off."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return ["--metrics.no_enable_tensorboard"]
    return []


# --- CPU: flavors and configs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", FLAVORS)
def test_cut_down_flavor_is_the_real_flavor_with_two_layers(model):
    real_name, name = FLAVORS[model]
    table = flavors.flavor_table(model)
    real, cut = table[real_name], table[name]
    assert dataclasses.asdict(cut) == {**dataclasses.asdict(real), "n_layers": 2}
    assert real.n_layers > 2
    if hasattr(real, "moe_args"):  # a copy: the trainer writes into the flavor's moe_args
        assert cut.moe_args is not real.moe_args
    from torchtitan.protocols.train_spec import get_train_spec

    assert get_train_spec(model).model_args[name] is cut  # what the trainer looks up
    assert f"{model}/{name}" in torchtitan_ext.REGISTERED_FLAVORS


def test_cut_down_flavors_keep_the_real_dimensions():
    """The numbers a user reads in the flavor names' models, spelled out."""
    llama = flavors.flavor_table("llama3")["8B_2layers"]
    assert (llama.dim, llama.n_heads, llama.n_kv_heads, llama.vocab_size) == (4096, 32, 8, 128256)
    qwen = flavors.flavor_table("qwen3")["30B-A3B_2layers"]
    assert (qwen.dim, qwen.n_heads, qwen.n_kv_heads, qwen.moe_inter_dim, qwen.vocab_size) == (2048, 32, 4, 768, 151936)
    assert (qwen.moe_enabled, qwen.moe_args.num_experts, qwen.moe_args.top_k) == (True, 128, 8)
    deepseek = flavors.flavor_table("deepseek_v3")["16B_2layers"]
    assert (deepseek.dim, deepseek.n_heads, deepseek.kv_lora_rank, deepseek.vocab_size) == (2048, 16, 512, 102400)
    assert (deepseek.n_dense_layers, deepseek.moe_args.num_experts, deepseek.moe_args.num_shared_experts) == (1, 64, 2)


def _meta_model(model: str, flavor: str) -> torch.nn.Module:
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(model)
    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(ConfigManager().parse_args([]))  # as the trainer does (DeepSeek-V3 needs it)
    with torch.device("meta"):
        return spec.model_cls(args)


@pytest.mark.parametrize("model", FLAVORS)
def test_cut_down_model_holds_the_real_models_first_two_layers(model):
    """Built on the meta device: every parameter of the cut-down model is the real model's, same name and shape,
    and the real model has nothing else but its layers from 2 on; DeepSeek-V3 keeps a dense and a MoE layer."""
    real_name, name = FLAVORS[model]
    cut = {n: p.shape for n, p in _meta_model(model, name).named_parameters()}
    real = {n: p.shape for n, p in _meta_model(model, real_name).named_parameters()}
    assert {n: real[n] for n in cut} == cut
    real_layers = {n.split(".")[1] for n in real if n.startswith("layers.")}
    assert {n.split(".")[1] for n in set(real) - set(cut)} == real_layers - {"0", "1"}
    moe_layers = sorted({n.split(".")[1] for n in cut if ".moe.experts." in n})
    assert moe_layers == {"llama3": [], "qwen3": ["0", "1"], "deepseek_v3": ["1"]}[model]


def test_cut_down_args_refuses_a_model_without_moe_layers():
    real = flavors.flavor_table("deepseek_v3")["16B"]
    with pytest.raises(ValueError, match="leaves no MoE layer"):
        flavors.cut_down_args(real, 1)
    assert flavors.cut_down_args(real, 3).n_layers == 3 and real.n_layers == 27


@pytest.mark.parametrize("model", CONFIGS)
def test_gpu_config_and_the_gpu_tests_overrides_pass_the_check(model, monkeypatch, capsys):
    config = ["--job.config_file", f"train_configs/{CONFIGS[model]}"]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["train", train.CHECK_ONLY, *config])
    train.main()  # only checks
    _, name = FLAVORS[model]
    assert f"{model} {name} + Muon (lr " in capsys.readouterr().out
    for optimizer in OPTIMIZERS:
        args = [*config, *gpu_args(model, optimizer)]
        assert train.config_problem(args) is None
        assert train.config_problem([*args, *RESUME, "--metrics.no_enable_tensorboard"]) is None


@pytest.mark.slow
@pytest.mark.parametrize("model", CONFIGS)
def test_check_config_command_passes_on_each_gpu_config(model):
    cmd = [sys.executable, "-m", "torchtitan_ext.train", "--check-config", "--job.config_file",
           f"train_configs/{CONFIGS[model]}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"{model} {FLAVORS[model][1]} + Muon")


def test_unknown_flavor_stops_the_launcher_with_the_closest_name():
    problem = train.config_problem(["--model.name", "llama3", "--model.flavor", "8B_2layer"])
    assert problem is not None and problem.startswith(
        "[model] flavor = '8B_2layer' is not a flavor of llama3 (did you mean '8B_2layers'?); its flavors: "
    )
    problem = train.config_problem(["--model.name", "llama5"])
    assert problem is not None and problem.startswith("[model] name = 'llama5' is not valid")


@pytest.mark.slow
def test_line_is_found_without_torchtitans_package_metadata(tmp_path):
    """torchtitan on PYTHONPATH without its .dist-info: the line comes from the package's files, and importing
    torchtitan_ext still registers the train specs and flavors."""
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "def version(name):\n"
        "    if name == 'torchtitan':\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "m.version = version\n"
        "import torchtitan_ext\n"
        "from torchtitan_ext import version\n"
        "print(version.LINE, version.VERSION, torchtitan_ext.REGISTERED_FLAVORS, torchtitan_ext.REGISTERED_MODELS)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("0.2 0.2 (no package metadata) ['llama3/8B_2layers', 'qwen3/30B-A3B_2layers', ")
    from torchtitan_ext import version

    assert version.line_from_layout(version.package_dir()) == "0.2"
    (tmp_path / "config").mkdir()
    assert version.line_from_layout(tmp_path) is None
    (tmp_path / "config" / "override.py").write_text("")
    assert version.line_from_layout(tmp_path) == "0.3"


# --- GPU: train, checkpoint, resume ---------------------------------------------------------------------------------


def torchrun_on_gpu(config: str, dump: Path, *overrides: str) -> tuple[int, str, dict[int, float]]:
    """One process under torchrun (:func:`titan_runs.torchrun`), cuBLAS deterministic."""
    return torchrun(
        config, dump, *overrides, nproc=1, timeout=900, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, tail=3000
    )


def event_losses(dump: Path, tb_folder: str) -> dict[int, float]:
    """The float32 losses of the run's TensorBoard events."""
    from torchtitan_ext import summary

    return dict(summary.scalars(summary.latest_events(dump, tb_folder))["loss_metrics/global_avg_loss"])


def check_log(output: str, losses: dict[int, float], steps: list[int], rule: str) -> None:
    """Every step logged a finite loss, an optimizer line and a FLOPs line with the MFU."""
    assert sorted(losses) == steps and all(math.isfinite(v) for v in losses.values()), losses
    optimizer_lines = [line for line in output.splitlines() if "optimizer: " in line]
    assert len(optimizer_lines) == len(steps), output[-3000:]
    assert all(OPTIMIZER_LINE.search(line) for line in optimizer_lines), optimizer_lines
    assert f"update_rms {rule} " in optimizer_lines[-1], optimizer_lines
    flops_lines = [line for line in output.splitlines() if "flops: model " in line]
    assert len(flops_lines) == len(steps) and all(FLOPS_LINE.search(line) for line in flops_lines), flops_lines


@pytest.mark.slow
@pytest.mark.e2e
@needs_gpu
@pytest.mark.xdist_group("real_dimension_trainings")  # one at a time under make test-gpu: 20-30 GB each
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model", CONFIGS)
def test_gpu_flavor_trains_and_resumes_with_the_same_losses(tmp_path, model, optimizer):
    need = CHECKPOINT_GB[model, optimizer] + 4
    free = shutil.disk_usage(tmp_path).free / 1e9
    if free < need:
        pytest.skip(f"needs {need} GB of free disk under {tmp_path} for the checkpoints, has {free:.0f} GB")
    config, dump = CONFIGS[model], tmp_path / "dump"
    args = [*gpu_args(model, optimizer), *tensorboard_args()]
    rule = optimizer.lower()
    try:
        code, output, uninterrupted = torchrun_on_gpu(config, dump, *args)
        assert code == 0, failure(output, 5000)
        check_log(output, uninterrupted, list(range(1, STEPS + 1)), rule)
        # each step's loss is over its own 2,048 tokens, so one step may rise over step 1 (SOAP on an H100:
        # 12.27, 12.00, 11.49, 12.42); a direction that does not descend stays above step 1 at every step
        assert min(uninterrupted[s] for s in range(2, STEPS + 1)) < uninterrupted[1], uninterrupted
        assert (dump / "checkpoint" / f"step-{SAVE_AT}" / ".metadata").is_file()
        shutil.rmtree(dump / "checkpoint" / f"step-{STEPS}")  # the weights-only last save: room on the disk

        code, output, resumed = torchrun_on_gpu(config, dump, *args, *RESUME)
        assert code == 0, failure(output, 5000)
        assert f"Training starts at step {SAVE_AT + 1}" in output, output[-5000:]
        after = list(range(SAVE_AT + 1, STEPS + 1))
        check_log(output, resumed, after, rule)
        expected = {step: uninterrupted[step] for step in after}
        assert resumed == expected, (
            f"resumed {resumed} != uninterrupted {expected}; the first resumed step "
            f"{'matches' if resumed[after[0]] == expected[after[0]] else 'differs'} (a forward pass of the restored weights)"
        )
        if not tensorboard_args():  # TensorBoard installed: the float32 losses too
            before = event_losses(dump, "tb")
            assert event_losses(dump, "tb_resumed") == {step: before[step] for step in after}
    finally:
        shutil.rmtree(dump / "checkpoint", ignore_errors=True)
