#!/usr/bin/env python3
"""Compile one of our Triton kernels for the H200 (sm_90a) without a GPU: registers, spills, instruction counts.

Why: a launch variant's registers, spills and MMA instruction (wgmma or mma.sync) decide whether it is worth a
device run, and whether a refactor left a proven kernel's code unchanged (``--ptx`` writes the PTX to diff). Triton
compiles for a GPU target offline, and its wheel bundles ptxas. Use the Triton the GPU runs (3.6.0 with torch
2.11.0+cu130 on our H200), unpacked anywhere (``pip download triton==3.6.0`` and unzip):

    python3 scripts/offline_ptx.py --triton /tmp/triton36 linear EPILOGUE=5 BLOCK_M=64 BLOCK_N=128 BLOCK_K=64 \\
        LN_RELOAD=1 --num-warps 8 --num-stages 3
    python3 scripts/offline_ptx.py --triton /tmp/triton36 attention BLOCK_M=64 NCACHED=4 --num-warps 4
    python3 scripts/offline_ptx.py --triton /tmp/triton36 entry D=32 BK_D=32 --num-warps 8 --num-stages 2
    python3 scripts/offline_ptx.py --triton /tmp/triton36 linear --num-warps 8 --pdl   # the PDL form's arithmetic
    python3 scripts/offline_ptx.py --triton /tmp/triton36 model --num-warps 8 --num-stages 2  # the persistent model

Constexprs not given take the defaults below (the op's launch on shape 6); ``--fp-fusion`` compiles with Triton's
default fp contraction instead of the kernels' ``enable_fp_fusion=False``. The arguments are specialized as Triton's
JIT specializes a launch (``DIVISIBLE``, ``ONES``; ``--no-specialize`` leaves them plain): so specialized, the split
layer launch compiles to the 218 registers and no spills the H200 reported, where plain arguments gave 255 and 632
bytes of spills. Prints one line of counts.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The kernels' runtime arguments and their types (the launchers pass int32 strides for the official shapes).
KERNELS = {
    "attention": ("kkdeploy.kernels._faithful_attention_triton", "_faithful_attention_kernel", {
        **{name: "*fp16" for name in ("Q", "K", "V", "OUT", "SCORES", "PROBS")}, "MASK": "*i1",
        **{name: "i32" for name in ("stride_qb", "stride_qs", "stride_kb", "stride_ks", "stride_vb", "stride_vs",
                                    "stride_ob", "stride_os", "stride_mb", "stride_ms", "S", "H")},
        "scale": "fp32", "E": "*fp32", "E_CHUNKS": "i32", "BH": "i32", "NUM_PROGRAMS": "i32"},
        {"HEAD_DIM": 32, "DH_PAD": 32, "BLOCK_M": 64, "LANES": 32, "SUB": 1, "CAUSAL": 1, "HAS_MASK": 1,
         "ACCURATE": 1, "DEBUG": 0, "ONE_PASS": 0, "NCACHED": 0, "FAST_DIV": 0, "PDL": 0, "RAW_MAX": 0,
         "INTERIOR": 0, "ECACHE": 0, "SLOTS": 0}),
    "qkv_attention": ("kkdeploy.kernels._qkv_attention_triton", "_qkv_attention_kernel", {
        **{name: "*fp16" for name in ("X", "WQ", "WK", "WV", "BQ", "BK", "BV", "OUT")}, "MASK": "*i1",
        **{name: "i32" for name in ("stride_xb", "stride_xs", "stride_w", "stride_ob", "stride_os", "stride_mb",
                                    "stride_ms", "S", "H", "D")},
        "scale": "fp32"},
        {"HEAD_DIM": 32, "DH_PAD": 32, "BLOCK_K": 64, "CAUSAL": 1, "HAS_MASK": 1, "ACCURATE": 1, "FAST_DIV": 1,
         "PDL": 0, "WHOLE": 0, "NK": 128, "PAIR": 0, "EARLY": 0, "EARLY_MASK": 0, "PV64": 0,
        "ROWS128": 0}),
    "linear": ("kkdeploy.kernels._fused_linear_triton", "_fused_linear_kernel", {
        **{name: "*fp16" for name in ("X", "W", "B", "R", "OUT", "LN_G", "LN_B", "OUT2")}, "MASK": "*i1",
        **{name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om")},
        "eps": "fp32"},
        {"EPILOGUE": 3, "HAS_MASK": 1, "ACCURATE": 1, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64,
         "LN_RELOAD": 0, "A_GELU": 0, "LN_ZERO_INVALID": 0, "PDL": 0, "COLUMNS_FIRST": 0, "EARLY": 0,
         "LN_EARLY": 0, "A_LN": 0}),
    "linear_tma": ("kkdeploy.kernels._fused_linear_triton", "_fused_linear_tma_kernel", {
        "XD": "tensordesc<fp16[128, 64]>", "WD": "tensordesc<fp16[128, 64]>", "B": "*fp16", "R": "*fp16",
        "MASK": "*i1", "OUT": "*fp16", **{name: "i32" for name in ("M", "N", "K", "stride_rm", "stride_om")}},
        {"EPILOGUE": 3, "HAS_MASK": 1, "ACCURATE": 1, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "A_GELU": 0,
         "PDL": 0, "WS": 0}),
    "linear_tma_persistent": ("kkdeploy.kernels._fused_linear_triton", "_fused_linear_tma_persistent_kernel", {
        "XD": "tensordesc<fp16[128, 64]>", "WD": "tensordesc<fp16[128, 64]>", "B": "*fp16", "R": "*fp16",
        "MASK": "*i1", "OUT": "*fp16", **{name: "i32" for name in ("M", "N", "K", "stride_rm", "stride_om")}},
        {"EPILOGUE": 3, "HAS_MASK": 1, "ACCURATE": 1, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64,
         "NUM_PROGRAMS": 132, "GROUP_M": 8, "A_GELU": 0, "PDL": 0}),
    "ffn": ("kkdeploy.kernels._fused_linear_triton", "_fused_ffn_kernel", {
        **{name: "*fp16" for name in ("X", "W1", "B1", "W2", "B2", "R", "OUT", "LN_G", "LN_B", "OUT2", "WQ", "BQ",
                                      "QKV")}, "MASK": "*i1",
        **{name: "i32" for name in ("M", "F", "D", "stride_xm", "stride_w1", "stride_w2", "stride_rm", "stride_om",
                                    "stride_wq", "stride_qm")},
        "eps": "fp32"},
        {"HAS_MASK": 1, "ACCURATE": 1, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_F": 64, "BLOCK_K": 64, "LN_RELOAD": 1,
         "LN_ZERO_INVALID": 0, "PDL": 0, "QKV_NEXT": 0}),
    "entry": ("kkdeploy.kernels._layer_triton", "_entry_kernel", {
        **{name: "*fp16" for name in ("X", "HN", "QKV", "G", "B", "WQKV", "BQKV")}, "S": "i32", "eps": "fp32"},
        {"D": 128, "BLOCK_M": 64, "BN_QKV": 128, "BK_D": 64, "ACCURATE": 1, "CHAIN_REGS": 0}),
    "layer": ("kkdeploy.kernels._layer_triton", "_layer_kernel", {
        **{name: "*fp16" for name in ("X", "QKV")}, "MASK": "*i1",
        **{name: "*fp16" for name in ("CTX", "X1", "H2", "FF", "X2", "HN", "QKV_NEXT", "WO", "BO", "LN2_G", "LN2_B",
                                      "W1", "B1", "W2", "B2", "LNN_G", "LNN_B", "WQKV", "BQKV")},
        "S": "i32", "scale": "fp32", "eps2": "fp32", "epsn": "fp32"},
        {"D": 128, "F": 128, "H": 4, "HEAD_DIM": 32, "DH_PAD": 32, "LANES": 32, "SUB": 1, "ONE_PASS": 0, "NCACHED": 4,
         "FAST_DIV": 1, "CAUSAL": 1, "HAS_MASK": 1, "ACCURATE": 1, "BLOCK_M": 64, "BK_D": 64, "BK_F": 64,
         "BN_F": 128, "BN_QKV": 128, "GELU_PROLOGUE": 1, "LAST": 0, "FUSE_ATTENTION": 0, "CHAIN_REGS": 0}),
    "model": ("kkdeploy.kernels._model_triton", "_model_kernel", {
        "X": "*fp16", "MASK": "*i1",
        **{name: "*fp16" for name in ("HN0", "QKV", "CTX", "X1", "H2", "FF", "X2", "HN")}, "SYNC": "*i32",
        **{name: "*fp16" for name in ("LN1_G", "LN1_B", "WQKV", "BQKV", "WO", "BO", "LN2_G", "LN2_B", "W1", "B1",
                                      "W2", "B2", "LNN_G", "LNN_B")}, "EPS2": "*fp32", "EPSN": "*fp32",
        **{name: "i32" for name in ("S", "M", "NQB", "NRT")}, "scale": "fp32", "eps1": "fp32", "TRACE_BUF": "*i64"},
        {"L": 4, "D": 128, "F": 128, "H": 4, "HEAD_DIM": 32, "DH_PAD": 32, "LANES": 32, "NCACHED": 4, "FAST_DIV": 1,
         "CAUSAL": 1, "HAS_MASK": 1, "ACCURATE": 1, "BLOCK_M": 64, "BK_D": 64, "BK_F": 64, "BN_F": 128,
         "BN_QKV": 128, "SYNC_BLOCK": 1024, "ROW_CHAIN": 1, "TRACE": 0, "CHAIN_REGS": 0, "CHAIN_QKV": 0}),
}
#: Triton's JIT specializes each launch on its arguments: a pointer or an integer divisible by 16 gets
#: ``tt.divisibility = 16`` (vectorized, aligned loads and stores), an integer equal to 1 becomes the constant 1. These
#: are the integer arguments so specialized on shape 3's launches (torch's allocations make every pointer divisible);
#: without them the loads compile to 16-bit scalar ones and the register counts are not the GPU's.
DIVISIBLE = {
    "attention": ("stride_qb", "stride_qs", "stride_kb", "stride_ks", "stride_vb", "stride_vs", "stride_ob",
                  "stride_os", "stride_mb", "S"),
    "qkv_attention": ("stride_xb", "stride_xs", "stride_w", "stride_ob", "stride_os", "stride_mb", "S", "D"),
    "linear": ("M", "N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om"),
    "linear_tma": ("M", "N", "K", "stride_rm", "stride_om"),
    "linear_tma_persistent": ("M", "N", "K", "stride_rm", "stride_om"),
    "ffn": ("M", "F", "D", "stride_xm", "stride_w1", "stride_w2", "stride_rm", "stride_om", "stride_wq", "stride_qm"),
    "entry": ("S", ),
    "layer": ("S", ),
    "model": ("S", "M"),
}
ONES = {"attention": ("stride_ms", ), "qkv_attention": ("stride_ms", )}
#: the kernels with a dependent-launch form (kkdeploy/kernels/dependent_launch.py)
PDL_KERNELS = ("attention", "qkv_attention", "linear", "linear_tma", "linear_tma_persistent", "ffn")
COUNTED = {"wgmma": r"wgmma\.mma_async", "mma.sync": r"\bmma\.sync", "fma.rn": r"fma\.rn\.f32",
           "div.rn": r"div\.rn\.f32", "rsqrt": r"rsqrt\.approx", "ex2": r"ex2\.approx", "bar.sync": r"bar\.sync"}


def parse_constexprs(pairs: list[str], defaults: dict) -> dict:
    values = dict(defaults)
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in defaults:
            raise SystemExit(f"offline_ptx: {pair!r}: give NAME=VALUE with NAME one of {', '.join(defaults)}")
        values[name] = int(value)
    return {k: bool(v) if k in ("CAUSAL", "HAS_MASK", "ACCURATE", "DEBUG", "ONE_PASS", "FAST_DIV", "LN_RELOAD",
                                "A_GELU", "LN_ZERO_INVALID", "GELU_PROLOGUE", "LAST", "FUSE_ATTENTION", "PDL",
                                "ROW_CHAIN", "TRACE", "RAW_MAX", "INTERIOR", "WS", "COLUMNS_FIRST", "QKV_NEXT") else v
            for k, v in values.items()}


def compile_ptx(kernel: str, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                fp_fusion: bool = False, specialize: bool = True, maxnreg: int | None = None) -> str:
    """The PTX of one of KERNELS for sm_90a, compiled here by the Triton on ``sys.path`` (no GPU needed), with the
    options our launchers pass (no fp contraction unless ``fp_fusion``; ``maxnreg``: a launch's register cap)."""
    return compile_asm(kernel, constexprs, num_warps, num_stages, fp_fusion, specialize, maxnreg)["ptx"]


def compile_asm(kernel: str, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                fp_fusion: bool = False, specialize: bool = True, maxnreg: int | None = None) -> dict:
    """``compile_ptx``'s compile, every stage Triton keeps (``"ttgir"``, ``"ptx"``, ...)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, runtime, _ = KERNELS[kernel]
    fn = getattr(importlib.import_module(module), name)
    if kernel in ("linear_tma", "linear_tma_persistent"):  # a descriptor's type holds its block shape
        runtime = {**runtime, "XD": f"tensordesc<fp16[{constexprs['BLOCK_M']}, {constexprs['BLOCK_K']}]>",
                   "WD": f"tensordesc<fp16[{constexprs['BLOCK_N']}, {constexprs['BLOCK_K']}]>"}
    attrs = {}
    if specialize:  # as the JIT specializes a launch (DIVISIBLE, ONES)
        constexprs = {**constexprs, **{name: 1 for name in ONES.get(kernel, ())}}
        runtime = {k: v for k, v in runtime.items() if k not in constexprs}
        attrs = {(fn.arg_names.index(name), ): [["tt.divisibility", 16]] for name, kind in runtime.items()
                 if kind.startswith("*") or name in DIVISIBLE.get(kernel, ())}
    signature = {**runtime, **{k: "constexpr" for k in constexprs}}
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fp_fusion,
               "enable_reflect_ftz": False}
    if maxnreg:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm


#: the TTGIR operations that move a tensor between layouts or into shared memory: what a thread's SASS pays in
#: shared-memory stores, loads and barriers between its arithmetic (the MMA operands staged for wgmma among them)
LAYOUT_MOVES = ("ttg.convert_layout", "ttg.local_alloc", "ttg.local_store")


def layout_moves(ttgir: str) -> list[tuple[int, str, str]]:
    """(count, operation, where) for each of ``LAYOUT_MOVES`` in the TTGIR, by source location: the innermost line
    first, then its callers (``file:line <- file:line ...``), most frequent first. Where a kernel's time goes
    between its MMAs: each conversion through shared memory is stores, a barrier and loads."""
    defs = dict(re.findall(r"^(#loc\d*) = loc\((.*)\)$", ttgir, re.M))

    def frames(loc: str, depth: int = 0) -> list[str]:
        text = defs.get(loc)
        if text is None or depth > 64:
            return []
        if m := re.match(r'"([^"]+)":(\d+):\d+', text):
            return [f"{Path(m.group(1)).name}:{m.group(2)}"]
        if m := re.match(r"callsite\((#loc\d*) at (#loc\d*)\)", text):
            return frames(m.group(1), depth + 1) + frames(m.group(2), depth + 1)
        if m := re.match(r'"[^"]*"\((#loc\d*)\)', text):
            return frames(m.group(1), depth + 1)
        return []

    counts: dict[tuple[str, str], int] = {}
    for line in ttgir.splitlines():
        op = next((name for name in LAYOUT_MOVES if f"{name} " in line), None)
        if op is None:
            continue
        loc = re.search(r"loc\((#loc\d*)\)\s*$", line)
        where = " <- ".join(frames(loc.group(1))) if loc else ""
        counts[(op, where or "?")] = counts.get((op, where or "?"), 0) + 1
    return sorted(((n, op, where) for (op, where), n in counts.items()), key=lambda r: (-r[0], r[1], r[2]))


def loop_counts(ptx: str) -> list[tuple[int, int]]:
    """(instructions, conversions) in each loop body of the PTX (a label to a branch back to it), in text order: what
    one iteration issues per thread, e.g. per key chunk in each pass of the attention."""
    lines = [line.strip() for line in ptx.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        branch = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if branch and labels.get(branch.group(1), i) < i:
            body = [x for x in lines[labels[branch.group(1)]:i + 1] if x and not x.startswith((".", "//", "$"))]
            loops.append((len(body), sum(1 for x in body if re.match(r"(?:@!?%p\d+\s+)?cvt\.", x))))
    return loops


#: SASS opcodes by the pipe that issues them on sm_90 (ncu's sm__inst_executed_pipe_*): the integer/compare/select
#: pipe (alu), the FP32/IMAD pipes (fma, two halves), the transcendental unit (xu), the tensor cores; the rest (loads,
#: branches, uniform datapath) is "other". ALU issues at half the FMA pipes' combined rate.
SASS_PIPES = {
    "alu": ("ISETP", "FSETP", "FSEL", "SEL", "LOP3", "PRMT", "SHF", "IADD3", "FMNMX", "IMNMX", "F2FP", "PLOP3", "LEA",
            "FCHK", "VIADD"),
    "fma": ("FFMA", "FADD", "FMUL", "IMAD", "HADD2", "HFMA2", "HMUL2", "IMUL", "MOV"),
    "xu": ("MUFU", "F2F", "I2F", "F2I"),
    "tensor": ("HGMMA", "HMMA"),
}


def sass_code(cubin: Path, cuobjdump: Path) -> list[tuple[int, str, int | None]]:
    """The compiled SASS as (address, opcode, backward or forward branch target or None), in address order."""
    text = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    code = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)[^;]*;", line)
        if m:
            target = re.search(r"\bBRA\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)", line)
            code.append((int(m.group(1), 16), m.group(2), int(target.group(1), 16) if target else None))
    return code


def sass_tail(code: list[tuple[int, str, int | None]]) -> tuple[int, int]:
    """(instructions in all, instructions after the last tensor-core MMA up to the last EXIT): the epilogue a thread
    runs once its GEMMs are done, where a short launch's latency chain is (the LayerNorm or GELU epilogue)."""
    ops = [op for _, op, _ in code]
    end = max((i for i, op in enumerate(ops) if op == "EXIT"), default=len(ops) - 1)
    last_mma = max((i for i, op in enumerate(ops) if op in SASS_PIPES["tensor"]), default=-1)
    return end + 1, end - last_mma


def sass_loops(cubin: Path, cuobjdump: Path, code=None) -> list[dict]:
    """Per loop body of the compiled SASS (a backward branch's span), in address order: its instructions by issue
    pipe (``SASS_PIPES``), what one iteration costs each pipe per thread."""
    code = sass_code(cubin, cuobjdump) if code is None else code
    loops = []
    for address, _, target in code:
        if target is not None and target < address:
            counts = dict.fromkeys([*SASS_PIPES, "other"], 0)
            for a, op, _ in code:
                if target <= a <= address:
                    pipe = next((p for p, ops in SASS_PIPES.items() if op in ops), "other")
                    counts[pipe] += 1
            counts["all"] = sum(counts.values())
            loops.append(counts)
    return loops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("constexprs", nargs="*", help="NAME=VALUE (integers; 0/1 for flags)")
    ap.add_argument("--triton", type=Path, required=True, help="folder holding the unpacked Triton package")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--fp-fusion", action="store_true", help="Triton's default fp contraction (the kernels: off)")
    ap.add_argument("--maxnreg", type=int, help="the registers a thread may use, as a launch's maxnreg sets them")
    ap.add_argument("--ptx", type=Path, help="also write the PTX here")
    ap.add_argument("--loops", action="store_true", help="also print each loop body's instructions and conversions")
    ap.add_argument("--sass", action="store_true",
                    help="also print the SASS instructions a thread runs (in all, and after the last MMA) and each "
                         "loop body's by issue pipe (ptxas and cuobjdump bundled with Triton)")
    ap.add_argument("--layouts", action="store_true",
                    help="also print the layout conversions and shared-memory stagings of the TTGIR, by source line")
    ap.add_argument("--no-specialize", dest="specialize", action="store_false",
                    help="compile without the JIT's specialization of the arguments (DIVISIBLE, ONES)")
    ap.add_argument("--pdl", action="store_true",
                    help="also compile the dependent-launch form (PDL=1) and say whether its arithmetic is the same")
    args = ap.parse_args(argv)
    ptxas = args.triton / "triton" / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        print(f"offline_ptx: no Triton with a bundled ptxas under {args.triton} (unpack the triton wheel there)",
              file=sys.stderr)
        return 2
    sys.path[:0] = [str(args.triton), str(REPO)]
    import triton

    constexprs = parse_constexprs(args.constexprs, KERNELS[args.kernel][3])
    asm = compile_asm(args.kernel, constexprs, args.num_warps, args.num_stages, args.fp_fusion, args.specialize,
                      args.maxnreg)
    ptx = asm["ptx"]
    if args.ptx:
        args.ptx.write_text(ptx)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "k.ptx")
        source.write_text(ptx)
        run = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(source), "-o", str(Path(tmp, "k.cubin"))],
                             capture_output=True, text=True)
        code = sass_code(Path(tmp, "k.cubin"), ptxas.with_name("cuobjdump")) if args.sass else []
        loops_sass = sass_loops(Path(tmp, "k.cubin"), ptxas.with_name("cuobjdump"), code) if args.sass else []
    registers = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    counts = " ".join(f"{label} {len(re.findall(pattern, ptx))}" for label, pattern in COUNTED.items())
    print(f"{args.kernel} triton {triton.__version__} sm_90a warps {args.num_warps} stages {args.num_stages}"
          f"{' fp-fusion' if args.fp_fusion else ''}: registers {registers.group(1) if registers else '?'}, "
          f"spill stores/loads {spills.group(1) if spills else '?'}/{spills.group(2) if spills else '?'} bytes; "
          f"{counts}")
    if args.loops:
        print("loops (instructions/conversions per iteration): "
              + (", ".join(f"{n}/{c}" for n, c in loop_counts(ptx)) or "none"))
    if args.sass:
        total, tail = sass_tail(code)
        print(f"SASS: {total} instructions a thread, {tail} after the last MMA")
        print("SASS loops (per iteration, by pipe): " + ("; ".join(
            " ".join(f"{k} {v}" for k, v in loop.items()) for loop in loops_sass) or "none"))
    if args.layouts:
        moves = layout_moves(asm["ttgir"])
        print(f"layout moves (TTGIR): {sum(n for n, op, _ in moves if op == 'ttg.convert_layout')} conversions, "
              f"{sum(n for n, op, _ in moves if op != 'ttg.convert_layout')} shared-memory stagings")
        for n, op, where in moves:
            print(f"  {n} {op.split('.')[-1]} {where}")
    if args.pdl and args.kernel in PDL_KERNELS:
        from kkdeploy.kernels.dependent_launch import ptx_difference

        differences = ptx_difference(ptx, compile_ptx(args.kernel, {**constexprs, "PDL": True}, args.num_warps,
                                                      args.num_stages, args.fp_fusion))
        print("PDL form: " + ("the same instructions and arithmetic, plus griddepcontrol.wait/launch_dependents"
                              if not differences else "differs: " + "; ".join(differences[:5])))
        return 1 if differences else (0 if run.returncode == 0 else 1)
    return 0 if run.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
