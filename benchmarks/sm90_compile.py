"""Compile a Gluon kernel for sm_90 on a machine without a GPU and report what ptxas made of it: registers,
spills, shared memory and SASS instruction counts, in all and for each warp-specialized partition (the code
between two ``setmaxnreg``s: the consumers' loops are the ones with HGMMAs, QGMMAs on FP8), and for each of its key
loops by kind (a key block's instructions for one warp: matmuls by shape, MUFU.EX2, float ops, loads, stores,
barriers; ``taken``: along the path with every forward branch inside the loop taken, a forward kernel's unmasked
block, the steady state the masked blocks' code would otherwise hide). Uses the ptxas and cuobjdump that
Triton's wheel ships, so kernels can be checked for register pressure before a GPU run.

    python benchmarks/sm90_compile.py dkdv [causal] [softcap]          # kernels/bwd_sm90.py
    python benchmarks/sm90_compile.py fused [causal] [softcap] [window] # kernels/bwd_sm90_ws.py, dense
    python benchmarks/sm90_compile.py fused-alibi|fused-varlen [causal] [softcap] [window]
    python benchmarks/sm90_compile.py fused-d64|fused-d128[-alibi|-varlen] [causal] [softcap] [knob=value ...]
                                        # the same kernel through its launcher (head dim 64: 128-row steps)
    python benchmarks/sm90_compile.py wide[-alibi|-varlen][-v192] [causal] [softcap] [window] [knob=value ...]
                                        # bwd_sm90_wide.py, 192/128 (192/192 with -v192), through the launcher's
                                        # own arguments; knobs: configs.OnePassConfig's (stages=1 dq_first=1 ...;
                                        # keys96=1: bwd_sm90_wide96.py, dense or -varlen)
    python benchmarks/sm90_compile.py fwd-ws [causal] [softcap] [window]  # kernels/fwd_sm90_ws.py, 64-key slots
    python benchmarks/sm90_compile.py fwd-ws-d64[-n256][-s3][-c3][-pp][-sink] [causal] [softcap] [window]  #
                                        # that kernel at head dim 64 (-d128 too), through its launcher: two consumer
                                        # warpgroups over two slots of 128 keys unless -c<consumers> / -n<keys> /
                                        # -s<slots> say otherwise; -pp: the consumers take turns (pingpong)
    python benchmarks/sm90_compile.py fwd-ws-d256-n64[-sink] [causal] [softcap]  # head dim 256, 64-key slots
    python benchmarks/sm90_compile.py fwd-ws-d192[-n64][-s3][-sink][-alibi] [causal] [softcap]  # 192/128 (q, k as
                                        # 128 + 64 columns), two 128-key slots unless -n / -s say otherwise
    python benchmarks/sm90_compile.py fwd-d128[-n128][-s1][-sink] [causal] [softcap]  # kernels/fwd_sm90.py (one
                                        # warpgroup, 64-row tiles) through its launcher: 64-key blocks, two slots
    python benchmarks/sm90_compile.py fwd-fp8[-d64|-d256][-blocks][-varlen] [causal] [softcap] [window] [knob=value ...]
                                        # kernels/fwd_sm90_fp8.py; -varlen through its launcher's own arguments;
                                        # knobs: fp8.Fp8Tile's (consumers=3 block_n=256 stages=2 pingpong=0 ...)
    python benchmarks/sm90_compile.py quant[-d64|-d256][-g<group>][-v][-varlen]
                                        # kernels/quant_fp8.py (Triton) through quant.quantize: its launch of q's
                                        # and k's rotation and cast (-v: v's cast); with an opcode histogram

``window``: a left bound (the kernel's MASK_LEFT; the fused and forward kernels).

The one-pass kernel's spills quoted in BENCHMARKS.md and kernels/bwd_sm90_ws.py come from the partitions'
STL/LDL counts here; ``loop_stl``/``loop_ldl``: those inside a partition's key loops (its innermost loops that hold
a matmul), where a spill costs every key block. Kernel arguments: benchmarks/sm90_cases.py.
"""
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.runtime.jit import create_function_from_signature, mangle_type

TARGET = GPUTarget("cuda", 90, 32)


def compile_gluon(fn, args: dict, constexprs: dict, **options):
    """``fn`` compiled for sm_90 with runtime ``args`` (their types taken as Triton's JIT would) and
    ``constexprs``; returns the compiled kernel."""
    signature = {name: mangle_type(value) for name, value in args.items()}
    signature.update({name: "constexpr" for name in constexprs})
    src = GluonASTSource(fn, signature, constexprs={(list(fn.arg_names).index(k), ): v
                                                     for k, v in constexprs.items()})
    return triton.compile(src, target=TARGET, options=options)


def compile_triton(fn, args: dict, constexprs: dict, **options):
    """Triton kernel ``fn`` compiled for sm_90 as its JIT specializes a launch with ``args`` (CPU tensors stand in:
    16-byte aligned pointers and ints divisible by 16 take ``tt.divisibility``, ints equal to 1 become constants, as
    on the GPU, so loads and stores vectorize as they would there) and ``constexprs``."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, _ = binder(**args, **constexprs)
    _, signature, constants, attrs = fn._pack_args(backend, {}, bound, specialization, backend.parse_options({}))
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=TARGET, options=options)


def report(kernel, name: str) -> dict:
    """Registers, spills and shared memory of ``kernel`` (from ptxas) and the SASS instruction count."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        open(path, "wb").write(kernel.asm["cubin"])
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        sass = subprocess.run([os.path.join(ptxas, "cuobjdump"), "--dump-sass", path], capture_output=True,
                              text=True).stdout
        usage = subprocess.run([os.path.join(ptxas, "cuobjdump"), "--dump-resource-usage", path],
                               capture_output=True, text=True).stdout
    meta = kernel.metadata
    ptx = kernel.asm["ptx"]
    insts = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    spill_st = sum("STL" in line for line in insts)
    spill_ld = sum("LDL" in line for line in insts)
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    out = dict(name=name, registers=int(regs.group(1)) if regs else None,
               stack=int(stack.group(1)) if stack else None, shared=meta.shared, instructions=len(insts), stl=spill_st, ldl=spill_ld,
               hgmma=sum("HGMMA" in line for line in insts),
               qgmma=sum("QGMMA" in line for line in insts), ptx_lines=ptx.count("\n"))
    print(out)
    regions = _regions(insts)
    for region in regions:
        print("  ", region)
    if not regions:
        # No warp-specialized partitions (a plain Triton kernel): its opcodes, memory ones with their widths.
        print("   opcodes", _opcodes(insts))
    return out


def _opcodes(insts: list) -> dict:
    """Static counts of ``insts``' opcodes, most frequent first (``LDG.E.128`` and ``STG.E.U8`` apart)."""
    counts = {}
    for line in insts:
        op = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(\S+)", line).group(1).rstrip(";")
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def _key_loops(insts: list) -> list:
    """The address ranges of the innermost loops that hold a matmul (the key loops): a loop is a predicated branch
    ``@P BRA`` to an earlier address (the unpredicated ones jump back from the out-of-line waits past the end),
    innermost when no other matmul loop lies inside it."""
    address = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16) for line in insts]
    loops = []
    for at, line in zip(address, insts):
        target = re.search(r"@!?U?P\w+ BRA (?:\S+ )?0x([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < at:
            loops.append((int(target.group(1), 16), at))
    mma = [a for a, line in zip(address, insts) if "GMMA" in line]
    loops = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi for a in mma)]
    return [(lo, hi) for lo, hi in loops
            if not any((lo, hi) != (lo2, hi2) and lo <= lo2 and hi2 <= hi for lo2, hi2 in loops)]


# A key loop's instructions by kind, by opcode prefix (the first that matches): what a key block costs one warp
# of the partition, in static instructions (a causal loop holds its masked and unmasked paths both).
_LOOP_KINDS = (("ex2", ("MUFU.EX2", )), ("ffma", ("FFMA", )), ("fp32", ("FMUL", "FADD")), ("cvt", ("F2FP", )),
               ("lds", ("LDS", "LDSM")), ("sts", ("STS", "STSM")), ("bar", ("BAR", )), ("mbar", ("SYNCS", )),
               ("fence", ("FENCE", "MEMBAR")), ("wgmma_sync", ("WARPGROUP", )), ("red", ("RED", "ATOM", "UBLKRED")),
               ("spill", ("STL", "LDL")), ("uniform", ("U", "R2UR")), ("branch", ("BRA", )))


def _loop_counts(body: list) -> dict:
    """:data:`_LOOP_KINDS` counts of a key loop's ``body`` (SASS lines; ``alu``: the rest, integer and select),
    its matmuls by shape (``HGMMA.64x128x16``: n) and its total."""
    counts = dict(n=len(body), **{kind: 0 for kind, _ in _LOOP_KINDS}, alu=0, mma={})
    for line in body:
        op = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(\S+)", line).group(1)
        if "GMMA" in op:
            shape = ".".join(op.split(".")[:2])
            counts["mma"][shape] = counts["mma"].get(shape, 0) + 1
            continue
        counts[next((kind for kind, prefixes in _LOOP_KINDS if op.startswith(prefixes)), "alu")] += 1
    return counts


def _taken_path(body: list) -> list:
    """A key loop's ``body`` less the code its forward branches inside the loop jump over: the path with every such
    branch taken, the unmasked block's in the forward kernels (their masked softmax falls through first)."""
    address = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16) for line in body]
    skipped = set()
    for i, line in enumerate(body):
        target = re.search(r"@!?U?P\w+ BRA (?:\S+ )?0x([0-9a-f]+)", line)
        if target and address[i] < int(target.group(1), 16) <= address[-1]:
            skipped.update(j for j in range(i + 1, len(body)) if address[j] < int(target.group(1), 16))
    return [line for j, line in enumerate(body) if j not in skipped]


def _regions(insts: list) -> list:
    """Instruction counts between consecutive ``USETMAXREG``s (a warp-specialized partition's code);
    ``loop_stl``/``loop_ldl``: the spills inside its key loops (:func:`_key_loops`); ``loops``: each key loop's
    counts by kind (:func:`_loop_counts`), keyed by its first address, ``taken`` those of its path with every
    in-loop forward branch taken (:func:`_taken_path`: a forward kernel's unmasked block)."""
    loops = _key_loops(insts)
    regions, current = [], None
    for line in insts:
        if "USETMAXREG" in line:
            current = dict(setmaxreg=re.search(r"USETMAXREG\S* [^;]*", line).group(0), n=0, stl=0, ldl=0, hgmma=0,
                           qgmma=0, mufu=0, shfl=0, sts=0, lds=0, loop_stl=0, loop_ldl=0, loops={})
            regions.append(current)
        if current is not None:
            current["n"] += 1
            for name, op in (("stl", "STL"), ("ldl", "LDL"), ("hgmma", "HGMMA"), ("qgmma", "QGMMA"), ("mufu", "MUFU"),
                             ("shfl", "SHFL"), ("sts", "STS"), ("lds", "LDS")):
                current[name] += op in line
            at = int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16)
            for lo, hi in loops:
                if lo <= at <= hi:
                    current["loop_stl"] += "STL" in line
                    current["loop_ldl"] += "LDL" in line
                    current["loops"].setdefault(f"{lo:x}", []).append(line)
    for region in regions:
        region["loops"] = {at: dict(_loop_counts(body), taken=_loop_counts(_taken_path(body)))
                           for at, body in region["loops"].items()}
    return [r for r in regions if r["hgmma"] or r["qgmma"]]


def _setmaxnreg(kernel):
    return re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "dkdv"
    causal = "causal" in sys.argv
    softcap = "softcap" in sys.argv
    window = "window" in sys.argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sm90_cases import case  # noqa: E402
    # knob=value: a configs.OnePassConfig field of the one-pass cases, an fp8.Fp8Tile one of fwd-fp8 (ints; 0/1 for
    # the switches).
    tiles = {name: int(value) for name, value in (arg.split("=") for arg in sys.argv[2:] if "=" in arg)}
    fn, args, constexprs, options = case(which, causal, softcap, window, tiles)
    compile_kernel = compile_gluon if isinstance(fn, GluonJITFunction) else compile_triton
    k = compile_kernel(fn, args, constexprs, **options)
    report(k, f"{which} causal={causal} softcap={softcap} window={window} {tiles or ''}")
    print("setmaxnreg", _setmaxnreg(k))
