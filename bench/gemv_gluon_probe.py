"""A warp-specialized block-FP8 GEMM for decode sizes in Gluon (Triton's explicit Hopper dialect), against the
engine's Triton kernel (engine/native/triton_fp8.py): an experiment for issue 25's batch-1 and batch-64 steps.

The engine's kernel streams llama3-8b's layer weights at ~3.5 TB/s at one row (gate_up 3.66, down 3.26, qkv and o
2.2-2.8), and a plain wgmma chain in the same structure, without scales or split-K sums, at 3.73 (the twenty-second
session's probe: bench/gemm_split_k_probe.py's noscale_noreduce). Triton's pipeliner issues each stage's loads from
the warps that then wait for them and do the arithmetic, with four CTA barriers and a memory fence per K block. Here
one warp only issues TMA loads, of the weight and the activation tiles, STAGES blocks ahead, into a ring of shared
memory; four warps wait on each stage's barrier, run the stage's wgmma (weight rows as the MMA's 64-row side, the
tokens as its N side, as the engine's swap-AB launch), scale it into the accumulator, and free the stage. The
weight's first stages are requested before the wait for the kernel ahead (programmatic dependent launch; the weight
never changes), the activations' after it. Split-K as the engine's: fp32 planes summed by its _sum_planes.

On the H200 (thirty-ninth session, bench/results/gpu_gemv_gluon_probe.json) it equals the engine's kernel bit for bit
at the engine's K splits, and is no faster but for gate_up at one row (29.5 us at 8 stages against 33.8): a long walk
of K blocks streams well, many short split programs and deep rings at 64 rows (fewer programs an SM) do not. The
persistent kind (a grid of at most one program an SM, each walking several (tile, split) items through one ring that
does not drain between them) is the next try; compiled for sm_90, not yet run. Since then the kernel walks items in
both kinds (the "ws" kind: one item a program; the split index now varies fastest over the programs), and (fortieth
session, not yet run either) the MMA warps load each K block's two scales one block ahead: in the measured kernel
those global loads came right before the block's barrier wait, so once the ring was full their latency was paid on
every 8 KB block of weights (at ~300 ns a block, 132 programs stream ~3.6 TB/s: a guess at the latency, not measured).

``--compile-only`` compiles every launch for sm_90 on the CPU (Triton's compiler and ptxas, no GPU) and prints what
each uses. On the device it checks each launch against the engine's kernel (bit for bit, and the relative error) and
times both in CUDA graphs with the weights cycled past the L2, as bench/gemm_small_m.py does.

    python bench/gemv_gluon_probe.py --compile-only                       # any machine with Triton 3.6+
    PYTHONPATH=/tmp/site:$PWD python3 bench/gemv_gluon_probe.py --out $OUT/gemv_gluon.json   # on the device
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gemm_small_m import GEMMS, quantized_cases, timed_us
from engine.native.fused_ops import Quantized, pdl_enabled, sm_count
from engine.native.triton_fp8 import BLOCK_K, SUM_ROWS, _sum_planes, fp8_block_gemm, k_splits, row_tile

BLOCK_N = 64  # weight rows a program: the wgmma's M side

# A TMA load into shared memory: Triton 3.6 (the GPU image's) calls it async_copy_global_to_shared, 3.9 async_load.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _loader(w_desc, x_desc, w_smem, x_smem, ready, empty, ITEMS, ITERS: gl.constexpr, K_PER_SPLIT: gl.constexpr,
            SPLITS: gl.constexpr, USE_PDL: gl.constexpr):  # fmt: skip
    """One warp: the tiles of every K block of this program's items (tile, split), one after another through one
    ring, so that it never drains between items."""
    STAGES: gl.constexpr = w_smem.type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    TILE_BYTES: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    FIRST: gl.constexpr = STAGES if STAGES < ITERS else ITERS
    pid = gl.program_id(0)
    first_n = (pid // SPLITS) * BLOCK_N
    first_k = (pid % SPLITS) * K_PER_SPLIT
    for i in gl.static_range(FIRST):  # the first item's weight tiles before the wait for the kernel ahead
        mbarrier.expect(ready.index(i), TILE_BYTES)
        tma_load(w_desc, [first_n, first_k + i * BLOCK_K], ready.index(i), w_smem.index(i))
    if USE_PDL:
        _gdc_wait()
    for i in gl.static_range(FIRST):
        tma_load(x_desc, [0, first_k + i * BLOCK_K], ready.index(i), x_smem.index(i))
    c = 0
    for item in range(pid, ITEMS, gl.num_programs(0)):
        off_n = (item // SPLITS) * BLOCK_N
        k_begin = (item % SPLITS) * K_PER_SPLIT
        for it in range(ITERS):
            if c >= FIRST:
                s = c % STAGES
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # the MMA of load c - STAGES read it
                mbarrier.expect(ready.index(s), TILE_BYTES)
                tma_load(w_desc, [off_n, k_begin + it * BLOCK_K], ready.index(s), w_smem.index(s))
                tma_load(x_desc, [0, k_begin + it * BLOCK_K], ready.index(s), x_smem.index(s))
            c += 1


@gluon.jit
def _mma(xs_ptr, s_ptr, out_ptr, part_ptr, M, stride_xs, stride_sn, stride_om, w_smem, x_smem, ready, empty, ITEMS,
         ITERS: gl.constexpr, SPLITS: gl.constexpr, USE_PDL: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The MMA warps, for each of this program's items in turn: each K block's product, scaled by the weight
    block's and the tokens' scales, added into the accumulator in K order (the engine kernel's arithmetic); then the
    item's output, or its split-K plane (the layout of engine/native/triton_fp8.py's _plane_offsets, one row tile,
    read by _sum_planes)."""
    STAGES: gl.constexpr = w_smem.type.shape[0]
    BLOCK_N: gl.constexpr = w_smem.type.shape[1]
    BLOCK_M: gl.constexpr = x_smem.type.shape[1]
    if USE_PDL:  # the activations' scales come from the kernel ahead
        _gdc_wait()
        _gdc_launch_dependents()
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_M, 32])  # fmt: skip
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    plane = (ITEMS // SPLITS) * BLOCK_M * BLOCK_N
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    total = (ITEMS - pid + programs - 1) // programs * ITERS  # this program's K blocks over all its items
    # Each K block's two scales are loaded one block ahead: their global loads' latency overlaps the block before.
    w_next = gl.load(s_ptr + ((pid // SPLITS) * BLOCK_N // 128) * stride_sn + (pid % SPLITS) * ITERS)
    x_next = gl.load(xs_ptr + ((pid % SPLITS) * ITERS) * stride_xs + rows, mask=rows < M, other=0.0)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout)
    for c in range(total):
        w_scale = w_next
        x_scale = x_next
        ahead = gl.minimum(c + 1, total - 1)
        item_ahead = pid + (ahead // ITERS) * programs
        kb_ahead = (item_ahead % SPLITS) * ITERS + ahead % ITERS
        w_next = gl.load(s_ptr + ((item_ahead // SPLITS) * BLOCK_N // 128) * stride_sn + kb_ahead)
        x_next = gl.load(xs_ptr + kb_ahead * stride_xs + rows, mask=rows < M, other=0.0)
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        part = warpgroup_mma(w_smem.index(s), x_smem.index(s).permute((1, 0)), acc, use_acc=False,
                             is_async=True)  # fmt: skip
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        mbarrier.arrive(empty.index(s), count=1)
        acc += part * w_scale * x_scale[None, :]
        if c % ITERS == ITERS - 1:  # the item's last K block: its output, or its split-K plane
            item = pid + (c // ITERS) * programs
            tile = item // SPLITS
            split = item % SPLITS
            off_n = tile * BLOCK_N
            if SPLITS == 1:
                gl.store(out_ptr + rows[None, :] * stride_om + (off_n + cols)[:, None],
                         acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[None, :])  # fmt: skip
            else:
                gl.store(part_ptr + split * plane + tile * BLOCK_M * BLOCK_N + rows[None, :] * BLOCK_N
                         + cols[:, None], acc, mask=(rows < M)[None, :])  # fmt: skip
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout)


@gluon.jit
def _gemv_kernel(w_desc, x_desc, xs_ptr, s_ptr, out_ptr, part_ptr, M, stride_xs, stride_sn, stride_om, ITEMS,
                 SPLITS: gl.constexpr, K_PER_SPLIT: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr,
                 num_warps: gl.constexpr):  # fmt: skip
    """Each program walks the (tile, split) items pid, pid + programs, ... through one ring of stages: one item a
    program (a grid of all items), or persistent (at most one program an SM: persistent_programs)."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    ITERS: gl.constexpr = K_PER_SPLIT // BLOCK_K
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma, (xs_ptr, s_ptr, out_ptr, part_ptr, M, stride_xs, stride_sn, stride_om, w_smem, x_smem, ready, empty,
                ITEMS, ITERS, SPLITS, USE_PDL, num_warps)),
        (_loader, (w_desc, x_desc, w_smem, x_smem, ready, empty, ITEMS, ITERS, K_PER_SPLIT, SPLITS, USE_PDL)),
    ], [1], [40])  # fmt: skip


def persistent_programs(items: int, sms: int) -> int:
    """The grid of the persistent kernel: the most programs, at most one an SM, that share the items evenly."""
    return max(d for d in range(1, min(items, sms) + 1) if items % d == 0)


def split_choices(asked: list[int], k: int, rule: int) -> list[int]:
    """The K split counts to try of those asked (0: the engine's rule): those dividing K's blocks, the rule's count
    once."""
    return [sp for sp in asked if not sp or ((k // BLOCK_K) % sp == 0 and sp != rule)]


def descriptors(xq: torch.Tensor, w: torch.Tensor, block_m: int) -> tuple:
    """Host-made TMA descriptors of the weight [N, K] (64 x 128 tiles) and the activations [R, K] (block_m x 128;
    rows past R come in as zeros)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], gl.float8e4nv)
    return (TensorDescriptor(w, list(w.shape), list(w.stride()), [BLOCK_N, BLOCK_K], w_layout),
            TensorDescriptor(xq, list(xq.shape), list(xq.stride()), [block_m, BLOCK_K], x_layout))  # fmt: skip


def gluon_gemm(x: Quantized, w: torch.Tensor, s: torch.Tensor, split_k: int | None = None, stages: int = 8,
               maxnreg: int = 80, persistent: bool = False) -> torch.Tensor:  # fmt: skip
    """x (quantized, M <= 64 rows) @ w.T with block scales -> [M, N] in x's dtype; splits as the engine's rule
    unless given; ``persistent``: a grid of at most one program an SM, else one program an item."""
    xq, xs, dtype, m = x
    if m > 64:
        raise ValueError(f"{m} rows: this kernel takes one row tile of at most 64")
    kp, n = xq.shape[1], w.shape[0]
    block_m = row_tile(m)
    tiles = n // BLOCK_N
    split_k = split_k or k_splits(m, kp, tiles, sm_count(xq.device))
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    part = torch.empty(split_k * tiles * block_m * BLOCK_N if split_k > 1 else 1, dtype=torch.float32,
                       device=xq.device)  # fmt: skip
    w_desc, x_desc = descriptors(xq, w, block_m)
    pdl = pdl_enabled(xq.device)
    items = tiles * split_k
    programs = persistent_programs(items, sm_count(xq.device)) if persistent else items
    _gemv_kernel[(programs,)](
        w_desc, x_desc, xs, s, out, part, m, xs.stride(1), s.stride(0), out.stride(0), items, SPLITS=split_k,
        K_PER_SPLIT=kp // split_k, STAGES=stages, USE_PDL=pdl, num_warps=4, maxnreg=maxnreg, launch_pdl=pdl,
    )  # fmt: skip
    if split_k > 1:
        _sum_planes[(tiles, 1, block_m // SUM_ROWS)](
            part, out, m, out.stride(0), SPLITS=split_k, BLOCK_M=block_m, BLOCK_N=BLOCK_N, ROWS=SUM_ROWS, USE_PDL=pdl,
            num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    return out


def compile_only(rows: list[int], stages: list[int], maxnregs: list[int], k_split: list[int]) -> list[dict]:
    """Every launch compiled for sm_90 on this machine (no GPU): registers, spills, shared memory. The kinds are one
    kernel (only their grids differ), compiled once."""
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    names = list(_gemv_kernel.arg_names)
    out = []
    launches = [(name, n, k, m, st, reg, sp or rule)
                for (name, (n, k)), m, st, reg in itertools.product(GEMMS.items(), rows, stages, maxnregs)
                for rule in [k_splits(m, k, n // BLOCK_N, 132)] for sp in split_choices(k_split, k, rule)]  # fmt: skip
    for name, n, k, m, st, reg, splits in launches:
        block_m = row_tile(m)
        w_desc, x_desc = descriptors(torch.empty(m, k, dtype=torch.float8_e4m3fn),
                                     torch.empty(n, k, dtype=torch.float8_e4m3fn), block_m)  # fmt: skip
        signature = {a: "constexpr" for a in names}
        signature.update(w_desc=mangle_type(w_desc), x_desc=mangle_type(x_desc), xs_ptr="*fp32", s_ptr="*fp32",
                         out_ptr="*bf16", part_ptr="*fp32", M="i32", stride_xs="i32", stride_sn="i32",
                         stride_om="i32")  # fmt: skip
        signature["ITEMS"] = "i32"
        constants = {(names.index(a),): v for a, v in
                     {"SPLITS": splits, "K_PER_SPLIT": k // splits, "STAGES": st, "USE_PDL": True,
                      "num_warps": 4}.items()}  # fmt: skip
        binary = triton.compile(GluonASTSource(_gemv_kernel, signature, constants),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": reg})  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(binary.asm["cubin"])
            usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        regs = usage.split("REG:")[1].split()[0]
        local = usage.split("LOCAL:")[1].split()[0]
        row = {"gemm": name, "m": m, "splits": splits, "stages": st, "maxnreg": reg, "registers": int(regs),
               "spilled": int(local), "shared": binary.metadata.shared}  # fmt: skip
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--stages", default="4,6,8,10")
    parser.add_argument("--maxnreg", default="80", help="registers a thread of the kernel's warps at most")
    parser.add_argument("--splits", default="rule", help="K splits: 'rule' (k_splits') or counts dividing K")
    parser.add_argument("--gemms", default="", help="only these of qkv,o,gate_up,down")
    parser.add_argument("--kinds", default="ws,persistent", help="ws (a program a tile and split), persistent")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report (no GPU needed)")
    args = parser.parse_args()
    rows, stages = [int(r) for r in args.rows.split(",")], [int(s) for s in args.stages.split(",")]
    maxnregs = [int(r) for r in args.maxnreg.split(",")]
    splits = [0 if v == "rule" else int(v) for v in args.splits.split(",")]  # 0: the rule's
    kinds = args.kinds.split(",")
    began = time.perf_counter()
    if args.compile_only:
        result: dict[str, object] = {"triton": triton.__version__, "target": "sm_90",
                                     "launches": compile_only(rows, stages, maxnregs, splits)}  # fmt: skip
    else:
        torch.manual_seed(0)
        found = []
        for name, m, x, ref, copies in quantized_cases(rows, args.gemms.split(",") if args.gemms else None):
            n, k = GEMMS[name]
            engine_us = timed_us(lambda x, w, s: fp8_block_gemm(x, w, s), copies, x)  # type: ignore[arg-type]
            found.append({"gemm": name, "m": m, "variant": "engine", "us": round(engine_us, 2),
                          "tb_s": round(n * k / engine_us / 1e6, 3)})  # fmt: skip
            print(json.dumps(found[-1]), flush=True)
            rule = k_splits(m, k, n // BLOCK_N, sm_count(x.q.device))
            for kind, st, reg, sp in itertools.product(kinds, stages, maxnregs, split_choices(splits, k, rule)):
                persistent = kind == "persistent"
                fn = lambda x, w, s, st=st, reg=reg, sp=sp, p=persistent: gluon_gemm(x, w, s, sp, st, reg, p)  # noqa: E731
                label = ("persistent" if persistent else "gluon") + f" s{st} r{reg}" + (f" k{sp}" if sp else "")
                row: dict[str, object] = {"gemm": name, "m": m, "variant": label}
                try:
                    got = fn(x, *copies[0])
                    row.update(same_as_engine=bool(torch.equal(got, ref)),
                               rel_err=round(((got.float() - ref.float()).norm() / ref.float().norm()).item(), 6),
                               us=round(us := timed_us(fn, copies, x), 2),  # type: ignore[arg-type]
                               tb_s=round(n * k / us / 1e6, 3))  # fmt: skip
                except Exception as exc:  # a launch that does not fit: recorded, the sweep goes on
                    row["error"] = str(exc)[:300]
                found.append(row)
                print(json.dumps(row), flush=True)
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "rows": found}  # fmt: skip
    result["seconds"] = round(time.perf_counter() - began, 1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
