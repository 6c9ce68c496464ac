"""torchtitan 0.3: the matrix optimizers through the ready configs (``--module torchtitan_ext.titan03``) and
through ``--override.imports`` on torchtitan's stock configs, trained by torchtitan's own trainer on CPU gloo
processes (``torchrun -m torchtitan_ext.titan03.train``); checkpoints resumed through torchtitan 0.3's own
optimizer checkpointing. Skipped unless the installed torchtitan is 0.3.x (``make test-titan03`` builds such
an environment).

Each training run is shared by the tests that read it (losses from rank 0's log lines, the optimizer and
FLOPs lines, TensorBoard scalars), and each run has a deadline.
"""

import glob
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ext.version import LINE, VERSION

if LINE != "0.3":
    pytest.skip(f"torchtitan 0.3.x tests; the installed torchtitan is {VERSION}", allow_module_level=True)

import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
from torchtitan.components.optimizer import default_adamw
from torchtitan.config import ConfigManager
from torchtitan.models.common.attention import get_causal_mask_mod, get_document_mask_mod

from torchtitan_ext.titan03 import cpu
from torchtitan_ext.titan03.container import MatrixOptimizersContainer, matrix_optimizer_config

ROOT = Path(__file__).resolve().parents[1]
LOSS_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+\w.]+)")
SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "128", "--metrics.log_freq", "1",
         "--metrics.disable_color_printing", "--lr_scheduler.warmup_steps", "2"]  # fmt: skip
STOCK = ["--hf_assets_path", "data/stdlib/tokenizer", "--dataloader.dataset_path", "data/stdlib/corpus",
         "--training.mixed_precision_param", "float32", "--metrics.enable_tensorboard"]  # fmt: skip
READY = ["--module", "torchtitan_ext.titan03"]
CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", "3"]
STEPS = 6


def torchrun(dump: Path, *args: str, nproc: int = 2, timeout: int = 300) -> tuple[int, str, dict[int, float]]:
    """Run the 0.3 launcher under torchrun with ``args``; return (returncode, rank 0's output, {step: loss}).
    On failure the tail of every rank's stderr is appended."""
    logs = dump / "ranks"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        "--local-ranks-filter", "0",
        "--log-dir", str(logs), "--tee", "3", "-m", "torchtitan_ext.titan03.train", *args, "--dump_folder", str(dump),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU processes even beside a GPU
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        for log in sorted(logs.rglob("stderr.log")):
            output += f"\n--- {log.relative_to(logs)} (tail) ---\n" + log.read_text(errors="replace")[-1500:]
    return proc.returncode, output, {int(s): float(v) for s, v in LOSS_LINE.findall(output)}


def falls(losses: dict[int, float], by: float) -> bool:
    """True when the mean of the last third of the logged losses is ``by`` below the mean of the first third."""
    values = [losses[k] for k in sorted(losses)]
    third = max(len(values) // 3, 1)
    return sum(values[-third:]) / third < sum(values[:third]) / third - by


def optimizer_lines(output: str, rule: str) -> list[str]:
    """The optimizer lines of ``output`` that report ``rule``'s update RMS."""
    return [line for line in output.splitlines() if f"optimizer: update_rms {rule} " in line]


def scalar_tags(dump: Path) -> set[str]:
    """Scalar tags of the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = glob.glob(str(dump / "tb" / "*"))
    events = EventAccumulator(run)
    events.Reload()
    return set(events.Tags()["scalars"])


class Run:
    """One training run and, where asked for, its resume from the checkpoint at step 3."""

    def __init__(self, root: Path, args: list[str], nproc: int = 2, resume: bool = False) -> None:
        self.full = root / "full"
        self.code, self.output, self.losses = torchrun(self.full, *args, nproc=nproc)
        self.resumed: tuple[int, str, dict[int, float]] | None = None
        if resume and self.code == 0:
            shutil.copytree(self.full / "checkpoint" / "step-3", root / "resumed" / "checkpoint" / "step-3")
            self.resumed = torchrun(root / "resumed", *args, nproc=nproc)

    def check_trained(self, rule: str) -> None:
        """The run ended well, every step logged a finite loss and an optimizer line of ``rule``, and the loss fell."""
        assert self.code == 0, self.output[-4000:]
        assert sorted(self.losses) == list(range(1, STEPS + 1)), self.losses
        assert all(math.isfinite(v) for v in self.losses.values())
        assert falls(self.losses, 0.2), self.losses
        assert len(optimizer_lines(self.output, rule)) == STEPS, self.output[-3000:]

    def check_resumed(self) -> None:
        """Resumed from step 3, steps 4.. give the uninterrupted run's losses."""
        assert self.resumed is not None
        code, output, losses = self.resumed
        assert code == 0, output[-4000:]
        assert "Training starts at step 4" in output
        assert losses == {s: self.losses[s] for s in range(4, STEPS + 1)}, (losses, self.losses)


@pytest.fixture(scope="module")
def llama3_ready_muon(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Llama3 debug through ``--config llama3_muon`` (Muon), FSDP over 2 ranks, with checkpoints and a resume."""
    args = [*READY, "--config", "llama3_muon", *SMALL, "--training.steps", str(STEPS), *CHECKPOINTS,
            "--optimizer.muon.diagnostics-interval", "3"]  # fmt: skip
    return Run(tmp_path_factory.mktemp("llama3_ready_muon"), args, resume=True)


@pytest.mark.slow
@pytest.mark.e2e
def test_ready_config_trains_llama3_with_muon_and_logs_its_metrics(llama3_ready_muon):
    run = llama3_ready_muon
    run.check_trained("muon")
    assert "Optimizer Muon (model_part=0)" in run.output
    assert re.search(r"Muon routing: adamw: \d+ parameters .*tok_embeddings\.weight", run.output)
    assert "lm_head.weight" in run.output.split("Muon routing: adamw:")[1].splitlines()[0]
    lines = optimizer_lines(run.output, "muon")
    assert [i + 1 for i, line in enumerate(lines) if "orth_err" in line] == [3, 6]
    flops = [line for line in run.output.splitlines() if "flops: model " in line]
    assert len(flops) == STEPS and all(line.endswith("mfu: not computed on CPU") for line in flops)
    tags = scalar_tags(run.full)
    assert {"loss_metrics/global_avg_loss", "muon/update_rms/muon", "muon/update_rms/adamw"} <= tags
    assert {"muon/optimizer_tflops_per_step", "tflops_with_optimizer", "muon/orthogonality_error"} <= tags


@pytest.mark.slow
@pytest.mark.e2e
def test_ready_config_resumes_with_the_same_losses(llama3_ready_muon):
    llama3_ready_muon.check_resumed()


@pytest.mark.slow
@pytest.mark.e2e
def test_override_puts_soap_on_the_stock_llama3_config(tmp_path):
    override = 'torchtitan_ext.titan03.overrides.soap={"lr": 0.01, "precondition_frequency": 2}'
    args = ["--module", "llama3", "--config", "llama3_debugmodel", *STOCK, *SMALL, "--training.steps", str(STEPS),
            "--override.imports", override]  # fmt: skip
    run = Run(tmp_path, args)
    run.check_trained("soap")
    assert "OptimizersContainer.Config -> MatrixOptimizersContainer.Config with lr=0.01, precondition_frequency=2" in (
        run.output
    )
    assert "muon/update_rms/soap" in scalar_tags(run.full)


@pytest.mark.slow
@pytest.mark.e2e
def test_ready_config_trains_soap_under_fsdp2_tp2_and_resumes(tmp_path):
    args = [*READY, "--config", "llama3_muon", "--optimizer.name", "SOAP", *SMALL, "--training.steps", str(STEPS),
            *CHECKPOINTS, "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2"]  # fmt: skip
    run = Run(tmp_path, args, nproc=4, resume=True)
    run.check_trained("soap")
    assert "tp=2" in run.output and "dp_shard=2" in run.output
    run.check_resumed()


@pytest.mark.slow
@pytest.mark.e2e
def test_override_puts_muon_on_the_stock_moe_config_under_ep2_and_resumes(tmp_path):
    """DeepSeek-V3's debug MoE (8 routed experts), experts over 2 expert-parallel ranks."""
    args = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", *STOCK, *SMALL, "--training.steps",
            str(STEPS), *CHECKPOINTS, "--parallelism.expert_parallel_degree", "2",
            "--override.imports", 'torchtitan_ext.titan03.overrides.muon={"lr": 0.01, "ns_dtype": "float32", '
            '"wire_dtype": "float32"}']  # fmt: skip
    run = Run(tmp_path, args, resume=True)
    run.check_trained("muon")
    assert "ep=2" in run.output
    run.check_resumed()


@pytest.mark.slow
@pytest.mark.e2e
def test_ready_moe_config_trains_with_soap(tmp_path):
    """DeepSeek-V3's debug MoE; sides above 512 keep the identity basis (a 4096-row eigendecomposition per MLA
    projection and step would take minutes on 2 cores)."""
    args = [*READY, "--config", "deepseek_v3_muon", "--optimizer.name", "SOAP", *SMALL, "--training.steps",
            str(STEPS), "--optimizer.soap.max-preconditioner-dim", "512"]  # fmt: skip
    Run(tmp_path, args).check_trained("soap")


@pytest.mark.slow
def test_override_with_an_unknown_key_stops_before_training_and_names_the_keys(tmp_path):
    args = ["--module", "llama3", "--config", "llama3_debugmodel", *STOCK, *SMALL,
            "--override.imports", 'torchtitan_ext.titan03.overrides.muon={"ns_step": 4}']  # fmt: skip
    code, output, losses = torchrun(tmp_path, *args, nproc=1, timeout=120)
    assert code != 0 and not losses
    assert "Muon has no option 'ns_step' (did you mean 'ns_steps'?); its options: lr, weight_decay," in output


def test_override_options_are_checked_and_keep_the_stock_hyperparameters():
    stock = default_adamw(lr=3e-4, weight_decay=0.05)
    config = matrix_optimizer_config(stock, "NorMuon", {"beta2": 0.9, "ns_steps": 3, "beta1": 0.8})
    assert isinstance(config, MatrixOptimizersContainer.Config) and config.name == "NorMuon"
    # NorMuon's own beta2 (its section's), not AdamW's; lr by the AdamW-to-Muon rule (10 × 3e-4)
    assert (config.lr, config.weight_decay, config.beta1, config.beta2) == (10 * 3e-4, 0.05, 0.8, 0.95)
    assert config.normuon.beta2 == 0.9 and config.normuon.ns_steps == 3
    kwargs = config.optimizer_kwargs()
    assert kwargs["lr"] == 10 * 3e-4 and kwargs["beta2"] == 0.9 and kwargs["ns_steps"] == 3
    with pytest.raises(ValueError, match=r"\[soap\] precondition_frequency = 0 is not valid"):
        matrix_optimizer_config(stock, "SOAP", {"precondition_frequency": 0})
    with pytest.raises(ValueError, match="'Lion' is not a matrix optimizer; choose one of: Muon, MOP"):
        matrix_optimizer_config(stock, "Lion")
    with pytest.raises(ValueError, match=r"\[optimizer\] fused_qkv"):
        matrix_optimizer_config(stock, "Muon", {"fused_qkv": "rows"})


def test_muon_from_a_stock_adamw_config_takes_ten_times_its_lr_and_an_lr_given_is_kept(caplog):
    """The measured rule (docs/lr_study.md): Muon and NorMuon with "match_rms_adamw" at 10× the AdamW lr they
    replace, SOAP and KL-SOAP matching AdamW's update RMS at 10× and 10/3×; an lr given, another adjust_lr_fn,
    another match_update_rms, or an unmeasured optimizer keep the lr they are given."""
    stock = default_adamw(lr=2.2e-4)
    with caplog.at_level(logging.INFO, logger="torchtitan_ext"):
        assert matrix_optimizer_config(stock, "Muon").lr == 10 * 2.2e-4
    assert "Muon: lr 0.0022 = 10 × the stock AdamW lr 0.00022" in caplog.text
    assert matrix_optimizer_config(stock, "Muon", {"lr": 1e-3}).lr == 1e-3
    assert matrix_optimizer_config(stock, "Muon", {"adjust_lr_fn": "original"}).lr == 2.2e-4
    with caplog.at_level(logging.INFO, logger="torchtitan_ext"):
        soap = matrix_optimizer_config(stock, "SOAP")
        klsoap = matrix_optimizer_config(stock, "KLSOAP")
    assert (soap.lr, soap.soap.match_update_rms) == (10 * 2.2e-4, 0.2)
    assert (klsoap.lr, klsoap.klsoap.match_update_rms) == (10 / 3 * 2.2e-4, 0.2)
    assert "SOAP: match_update_rms 0.2 (an AdamW update's RMS" in caplog.text
    assert "KLSOAP: lr 0.000733333 = 3.33333 × the stock AdamW lr 0.00022" in caplog.text
    unmatched = matrix_optimizer_config(stock, "SOAP", {"match_update_rms": 0.0})
    assert (unmatched.lr, unmatched.soap.match_update_rms) == (2.2e-4, 0.0)
    assert matrix_optimizer_config(stock, "SOAP", {"lr": 1e-3}).lr == 1e-3
    assert matrix_optimizer_config(stock, "MOP").lr == 2.2e-4  # MOP and REKLS were not in the study
    assert matrix_optimizer_config(stock, "REKLS").lr == 2.2e-4
    converted = matrix_optimizer_config(stock, "Muon")
    assert matrix_optimizer_config(converted, "NorMuon").lr == converted.lr  # a Muon config is not converted again


@pytest.mark.parametrize("name", ["llama3_muon", "qwen3_muon", "deepseek_v3_muon", "qwen3_moe_muon"])
def test_ready_configs_carry_ten_times_the_stock_adamw_lr(name):
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel, qwen3_moe_debug

    from torchtitan_ext.titan03 import config_registry

    stock = {
        "llama3_muon": llama3_debugmodel,
        "qwen3_muon": qwen3_debugmodel,
        "deepseek_v3_muon": deepseek_v3_debugmodel,
        "qwen3_moe_muon": qwen3_moe_debug,
    }[name]()
    (adamw,) = [g for g in stock.optimizer.param_groups if g.optimizer_name in ("Adam", "AdamW")][:1]
    ready = getattr(config_registry, name)().optimizer
    assert ready.lr == 10 * adamw.optimizer_kwargs["lr"]
    assert ready.soap.match_update_rms == ready.klsoap.match_update_rms == 0.2  # --optimizer.name SOAP: the rule


def test_ready_configs_and_cli_options_parse():
    manager = ConfigManager()
    for name in ("llama3_muon", "qwen3_muon", "deepseek_v3_muon", "qwen3_moe_muon"):
        config = manager.parse_args([*READY, "--config", name])
        assert type(config.optimizer) is MatrixOptimizersContainer.Config and config.optimizer.name == "Muon"
    config = manager.parse_args([*READY, "--config", "llama3_muon", "--optimizer.name", "REKLS",
                                 "--optimizer.rekls.precondition-frequency", "5"])  # fmt: skip
    assert config.optimizer.name == "REKLS" and config.optimizer.rekls.precondition_frequency == 5
    assert config.optimizer.optimizer_kwargs()["basis"] == "eigh"


def test_dense_attention_keeps_the_document_causal_mask():
    """The CPU path's dense attention equals FlexAttention (eager) with torchtitan's causal ∧ document mask,
    output and log-sum-exp, grouped-query heads included."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 64, 16
    positions = torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)]).repeat(batch, 1)
    mask_mod = and_masks(get_causal_mask_mod(), get_document_mask_mod(positions))
    block_mask = create_block_mask(mask_mod, batch, None, length, length, device="cpu", BLOCK_SIZE=16)
    q = torch.randn(batch, heads, length, dim, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, length, dim, dtype=torch.float64) for _ in range(2))
    expected, aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    out, lse = cpu.dense_attention(q, k, v, block_mask, enable_gqa=True, return_lse=True)
    # the eager FlexAttention reference rounds to ~1e-7 even in float64
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, aux.to(lse.dtype), rtol=1e-5, atol=1e-6)
    plain, _ = cpu.dense_attention(q, k, v, block_mask, enable_gqa=True)
    torch.testing.assert_close(plain, expected, rtol=1e-5, atol=1e-6)
    # a token attends to nothing of the previous document
    v_doc = v.clone()
    v_doc[:, :, :20] += 100.0
    moved, _ = cpu.dense_attention(q, k, v_doc, block_mask, enable_gqa=True)
    torch.testing.assert_close(moved[:, :, 20:], out[:, :, 20:])


def test_container_runs_step_pre_hooks_and_round_trips_torchtitans_flat_state():
    """The container steps torchtitan's registered pre-hooks (the MoE load-balancing hook's path) and its
    ``state_dict()`` is torchtitan 0.3's flat, name-keyed optimizer state, which loads back into a fresh one."""
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings, self.w1 = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 12, bias=False)
            self.norm, self.lm_head = torch.nn.LayerNorm(12), torch.nn.Linear(12, 8, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.norm(self.w1(self.tok_embeddings(tokens))))

    def model() -> torch.nn.Module:
        return Tiny()

    def train_step(net: torch.nn.Module, container: MatrixOptimizersContainer) -> None:
        net(torch.arange(4)).square().sum().backward()
        container.step()
        container.zero_grad()

    net = model()
    config = matrix_optimizer_config(default_adamw(lr=0.01), "Muon", {"ns_dtype": "float32", "wire_dtype": "float32"})
    container = config.build(model_parts=[net])
    calls = []
    container.register_step_pre_hook(lambda *args, **kwargs: calls.append(1))
    train_step(net, container)
    assert calls == [1]
    state = container.state_dict()
    assert {
        "state.w1.weight.momentum_buffer",
        "state.tok_embeddings.weight.exp_avg",
        "state.lm_head.weight.exp_avg",
    } <= set(state)
    assert all(key.startswith(("state.", "param_groups.")) for key in state)
    twin = model()
    twin.load_state_dict(net.state_dict())
    other = config.build(model_parts=[twin])
    other.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    train_step(net, container)
    train_step(twin, other)
    for a, b in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("parallelism", [[], ["--parallelism.tensor_parallel_degree", "2"]], ids=["fsdp2", "tp2"])
def test_ready_config_with_a_low_qk_clip_tau_clips_the_fused_qkv_heads_and_trains(tmp_path, parallelism):
    """The Llama3 debug model's fused, interleaved wqkv: the plug-in reads its heads (AttentionHeads.grouped_qkv)
    and its SDPA inputs; with τ = 0.1, below the first step's logits, heads are clipped and the next step's
    forward sees logits back near τ. Under TP 2 each rank sees 8 of a layer's 16 heads: all 96 heads of the
    first step are clipped, their maxima assembled over both ranks."""
    args = [*READY, "--config", "llama3_muon", *SMALL, "--training.steps", "4", "--optimizer.muon.qk-clip-tau", "0.1",
            *parallelism]  # fmt: skip
    code, output, losses = torchrun(tmp_path, *args)
    assert code == 0, output[-4000:]
    fields = [line.split("qk_clip max ")[1].split() for line in optimizer_lines(output, "muon")]
    assert len(fields) == 4, output[-3000:]
    peak, clipped = [float(f[0]) for f in fields], [int(f[2]) for f in fields]
    assert clipped[0] > 0 and peak[0] > 0.1 and peak[1] < peak[0] / 2, (peak, clipped)
    assert clipped[0] == 96 or not parallelism, clipped
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    # FlexAttention on the CPU path: its kernel returns no max_scores there, the maxima come from the fallback
    source = re.search(r"QK-clip: logit maxima of \d+ attention layers: \d+ by the exact fallback", output)
    assert source, output[-3000:]


def test_qk_clip_kernel_path_hands_over_flex_attentions_row_maxima_and_its_own_result(monkeypatch):
    """torchtitan 0.3's FlexAttention (its compiled function replaced by a CPU stand-in with the kernel's results,
    which torch 2.13 returns on CUDA only): hooked by the kernel path, each forward hands over the per-head max of
    the row maxima and returns what it returns unhooked, with and without ``out_transform`` (the lse)."""
    from torch.nn.attention.flex_attention import AuxOutput
    from torchtitan.models.common.attention import FlexAttention

    from torchtitan_ext import qk_clip

    def stand_in(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        out, lse = cpu.dense_attention(q, k, v, block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True)
        keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        mask = qk_clip.dense_mask(block_mask, q.device)
        rows = ((q @ keys.transpose(-2, -1)) * scale).masked_fill(~mask, -math.inf).amax(dim=-1)
        return out, AuxOutput(lse if return_aux.lse else None, rows if return_aux.max_scores else None)

    monkeypatch.setattr(FlexAttention, "compiled_flex_attn", staticmethod(stand_in))
    inner, length = FlexAttention.Config().build(), 32
    positions = torch.cat([torch.arange(12), torch.arange(20)]).repeat(2, 1)
    mask_mod = and_masks(get_causal_mask_mod(), get_document_mask_mod(positions))
    block_mask = create_block_mask(mask_mod, 2, None, length, length, device="cpu", BLOCK_SIZE=16)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, length, h, 8, generator=g) for h in (4, 2, 2))  # [batch, seq, heads, dim]
    call = {"attention_masks": block_mask, "scale": 0.3, "enable_gqa": True}
    keep_lse = {"out_transform": lambda out, lse: (out, lse)}
    plain, (plain_out, plain_lse) = inner(q, k, v, **call), inner(q, k, v, **call, **keep_lse)
    recorded = []
    heads = qk_clip.AttentionHeads(q="wq", k="wk", n_heads=4, head_dim=8, n_kv_heads=2)
    handles, paths = qk_clip.record_maxima({"a": (inner, heads)}, lambda *r: recorded.append(r), torch.device("cuda"))
    assert paths == {"a": None}
    assert torch.equal(inner(q, k, v, **call), plain)
    out, lse = inner(q, k, v, **call, **keep_lse)
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    want = qk_clip.max_logits(q.transpose(1, 2), k.transpose(1, 2), 0.3, qk_clip.dense_mask(block_mask, q.device))
    assert [layer for layer, _ in recorded] == ["a", "a"]
    assert all(torch.allclose(maxima, want, rtol=1e-6, atol=0) for _, maxima in recorded)
    for handle in handles:
        handle.remove()


def _tiny_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {"tok_embeddings": torch.nn.Embedding(16, 8), "w1": torch.nn.Linear(8, 12), "lm_head": torch.nn.Linear(12, 16)}
    )


@pytest.mark.parametrize(
    "options, ns_dtype, wire_dtype",
    [
        ({}, torch.float32, torch.float32),
        ({"ns_dtype": "bfloat16", "wire_dtype": "bfloat16"}, torch.bfloat16, torch.bfloat16),
        ({"ns_dtype": "bfloat16"}, torch.bfloat16, torch.float32),
    ],
)
def test_a_cpu_job_takes_float32_newton_schulz_and_wire_unless_they_are_set(options, ns_dtype, wire_dtype, caplog):
    """CPUs without AVX-512 BF16 run bfloat16 matrix products many times slower: the container builds unset dtypes
    as float32 on CPU parameters and logs it; a value given is kept; on GPUs the unset ones stay bfloat16."""
    config = matrix_optimizer_config(default_adamw(lr=0.01), "Muon", options)
    with caplog.at_level(logging.INFO, logger="torchtitan_ext"):
        (opt,) = config.build(model_parts=[_tiny_lm()]).optimizers
    assert next(g for g in opt.param_groups if g["use_muon"])["ns_dtype"] is ns_dtype
    assert opt._engine_options["wire_dtype"] is wire_dtype
    notes = [r.getMessage() for r in caplog.records if "not set, and this job runs on CPU" in r.getMessage()]
    moved = [key for key in ("ns_dtype", "wire_dtype") if key not in options]
    why = "this job runs on CPU, where bfloat16 matrix products run many times slower (CPUs without AVX-512 BF16)"
    settings = ", ".join(f"{key} = 'float32'" for key in moved)
    assert notes == ([f"[optimizer.muon] {settings}: not set, and {why}; setting {' and '.join(moved)} keeps your "
                      "choice"] if moved else [])  # fmt: skip
    if not options:
        gpu = config.optimizer_kwargs(on_cpu=False)
        assert (gpu["ns_dtype"], gpu["wire_dtype"]) == (torch.bfloat16, torch.bfloat16)


def test_ready_configs_and_overrides_leave_the_dtypes_to_the_device_unless_given():
    from torchtitan.config.override import apply_overrides

    manager = ConfigManager()
    override = "torchtitan_ext.titan03.overrides.muon="
    for args, expected in (
        ([*READY, "--config", "llama3_muon"], torch.float32),
        ([*READY, "--config", "llama3_muon", "--optimizer.muon.wire-dtype", "bfloat16"], torch.bfloat16),
        (["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports", override + "{}"], torch.float32),
        (
            ["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports",
             override + '{"ns_dtype": "bfloat16", "wire_dtype": "bfloat16"}'],
            torch.bfloat16,
        ),
    ):  # fmt: skip
        config = manager.parse_args(args)
        apply_overrides(config.override, config)  # as the trainer does first
        kwargs = config.optimizer.optimizer_kwargs(on_cpu=True)
        assert kwargs["ns_dtype"] is expected and kwargs["wire_dtype"] is expected, args
