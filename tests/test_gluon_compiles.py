"""The warp-specialized Gluon SYRK kernel compiles for Hopper (sm90) with the installed Triton, on any machine.

The kernel runs only on a Hopper GPU, which CI does not have, and Gluon's API changes between Triton releases
(3.9 removed the TMA copy names 3.6 has: ``kernels/ws_syrk_kernel.py`` takes whichever this Triton has). Here
Triton compiles it ahead of time for compute capability 9.0, for the flag sets the library launches (whole
operands, transposed views, lower tiles in and out), with the library's own constants (``kernels/ws_syrk.py``), and the result must be a Hopper kernel: warpgroup MMAs, TMA
copies, and shared memory within the 227 KiB an sm90 block may take.
"""

from __future__ import annotations

import re

import pytest
import torch

ws_syrk = pytest.importorskip("dtensor_muon.kernels.ws_syrk")
if ws_syrk.ws_syrk_kernel is None:
    pytest.skip("this Triton has no Gluon Hopper API", allow_module_level=True)
compiler = pytest.importorskip("triton.backends.compiler")
gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")
jit = pytest.importorskip("triton.runtime.jit")

SM90_MAX_SHARED_BYTES = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin on compute capability 9.0


def compile_for_hopper(
    transposed: bool, has_c: bool, has_diag: bool, scale_power: int, lower_in: bool = False, lower_out: bool = False
):
    """The kernel as :func:`ws_syrk._launch` first launches it for these flags (bf16, 32-bit sizes), its
    operands' descriptors from :func:`ws_syrk._operand_descriptors`."""
    import triton

    kernel = ws_syrk.ws_syrk_kernel
    m = 768
    if lower_in:
        x = torch.empty(4, m, m, dtype=torch.bfloat16)
    else:
        x = torch.empty(4, 2048, m, dtype=torch.bfloat16).mT if transposed else torch.empty(4, m, 2048)
        x = x.to(torch.bfloat16)
    desc_a, desc_a_cols = ws_syrk._operand_descriptors(x, transposed, lower_in)
    out = torch.empty(4, m, m, dtype=torch.bfloat16)
    out_block = (1, ws_syrk.BLOCK, ws_syrk.BLOCK)
    desc_out = ws_syrk.TensorDescriptor.from_tensor(out, list(out_block), ws_syrk._nvmma(out_block, out.dtype))
    constexprs = {
        "TRANSPOSED": transposed,
        "LOWER_IN": lower_in,
        "LOWER_OUT": lower_out,
        "HAS_C": has_c,
        "HAS_DIAG": has_diag,
        "SCALE_POWER": scale_power,
        "ROWS_LAYOUT": ws_syrk._nvmma((1, ws_syrk.BLOCK, ws_syrk.BLOCK_K), x.dtype),
        "COLUMNS_LAYOUT": ws_syrk._nvmma((1, ws_syrk.BLOCK_K, ws_syrk.BLOCK), x.dtype),
        "ACC": ws_syrk._accumulator_layout(),
        "BM": ws_syrk.BLOCK,
        "BK": ws_syrk.BLOCK_K,
        "STAGES": ws_syrk.STAGES,
        "TURN_LEAD": ws_syrk.TURN_LEAD,
        "CONSUMER_REGS": ws_syrk.CONSUMER_REGS,
        "PRODUCER_REGS": ws_syrk.PRODUCER_REGS,
    }
    descriptors = {
        "desc_a": desc_a,
        "desc_a_cols": desc_a_cols,
        "desc_b": desc_a,
        "desc_b_cols": desc_a_cols,
        "desc_out": desc_out,
        "desc_c": desc_out,
    }
    constexprs.update({name: None for name, desc in descriptors.items() if desc is None})
    signature = {
        **{name: jit.mangle_type(desc) for name, desc in descriptors.items() if desc is not None},
        "scale_ptr": "*fp32",
        **dict.fromkeys(("K", "total", "per_matrix"), "i32"),
        **dict.fromkeys(("alpha", "beta", "diag"), "fp32"),
        **dict.fromkeys(constexprs, "constexpr"),
    }
    names = kernel.arg_names
    assert set(signature) == set(names), "the test's arguments must be the kernel's"
    source = gluon_runtime.GluonASTSource(
        kernel, {name: signature[name] for name in names}, {(names.index(k),): v for k, v in constexprs.items()}
    )
    options = {"num_warps": 4, "maxnreg": ws_syrk.MAX_REGS}
    return triton.compile(source, target=compiler.GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.parametrize(
    ("transposed", "has_c", "has_diag", "scale_power", "lower_in", "lower_out"),
    [
        (False, False, False, 2, False, False),
        (True, True, True, 1, False, False),
        (False, False, False, 2, False, True),
        (True, False, False, 2, False, True),
        (False, False, False, 1, True, True),
        (False, True, True, 1, True, False),
    ],
    ids=[
        "gram",
        "transposed poly",
        "gram to lower tiles",
        "transposed gram to lower tiles",
        "product on lower tiles",
        "poly from lower tiles",
    ],
)
def test_the_gluon_kernel_compiles_for_hopper(
    transposed: bool, has_c: bool, has_diag: bool, scale_power: int, lower_in: bool, lower_out: bool
):
    compiled = compile_for_hopper(transposed, has_c, has_diag, scale_power, lower_in, lower_out)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert re.search(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global", ptx)  # TMA loads
    assert "cp.async.bulk.tensor.3d.global.shared::cta" in ptx  # TMA stores
    # The ring (STAGES slots of two BLOCK×BLOCK_K bf16 panels), two BLOCK² staging tiles, and the barriers.
    ring = ws_syrk.STAGES * 2 * ws_syrk.BLOCK * ws_syrk.BLOCK_K * 2
    staging = 2 * ws_syrk.BLOCK * ws_syrk.BLOCK * 2
    assert ring + staging <= compiled.metadata.shared <= SM90_MAX_SHARED_BYTES
