"""The engine's decode attention kernel compiled for sm_90 without a GPU: its SASS loop, counted.

Triton compiles to PTX on any machine and its wheel bundles ptxas and cuobjdump, so the instructions a
kernel variant issues per KV tile can be read before a device call is spent on it. The runtime
specialises pointers and strides divisible by 16 (their loads vectorise); the same hints are given here
by hand. Prints the register use and, for the kernel's KV-tile loop (the backward branch's body), the
instructions per warp by opcode. It showed a token-major fp8 V tile read one byte per load (128 LDS.U8
per thread per tile), the reason the engine stores fp8 V dim-major.

    pip install --no-deps --target /tmp/tri triton==3.6.0        # CPU machine: not a furlong dependency
    PYTHONPATH=/tmp/tri:. python3 bench/kernel_sass.py [--kv fp8|fp8_vtok|bf16] [--warps 1] [--stages 2]
        [--block-n 64] [--cascade | --transposed] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import inspect
import re
import subprocess
from pathlib import Path

from furlong.engine.splits import programs_per_sm

POINTERS_FP8 = dict(Q="*bf16", K="*fp8e4nv", V="*fp8e4nv", KS="*fp32", VS="*fp32", BT="*i32", CL="*i32",
                    PL="*i32", GR="*i32", GP="*i32", O="*fp32", LSE="*fp32", OUT="*bf16")


def compile_kernel(kv: str, warps: int, stages: int, block_n: int, cascade: bool, transposed: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from furlong.engine.kernels import _decode_attn_kernel
    from furlong.engine.kernels_transposed import _decode_attn_transposed_kernel
    fp8 = kv != "bf16"
    ptrs = dict(POINTERS_FP8)
    if not fp8:
        ptrs.update(K="*bf16", V="*bf16", KS="*i32", VS="*i32")
    # the Qwen3-0.6B shape, as the engine launches it
    const = dict(GROUP=2, QP=16, MEMBERS=8 if cascade else 1, D=128, PAGE=64, BLOCK_N=block_n,
                 DIRECT=not cascade, CASCADE=cascade, FP8=fp8, PRECISION="tf32", DOT=triton.language.float16,
                 EARLY_V=fp8, V_DIM_MAJOR=kv == "fp8")
    kernel = _decode_attn_kernel
    if transposed:      # fp8, V dim-major (kernels_transposed.py; cascade: a cascade launch's row programs)
        kernel = _decode_attn_transposed_kernel
        const = dict(GROUP=2, GP=8, D=128, PAGE=64, BLOCK_N=block_n, DIRECT=not cascade,
                     DOT=triton.language.float16, PRECISION="tf32", CASCADE=cascade)
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {p: "constexpr" if p in const else ptrs.get(p, "fp32" if p == "scale" else "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if p not in const and (p in ptrs or p.startswith("s_"))}
    src = ASTSource(kernel, sig, constexprs={p: const[p] for p in params if p in const}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def loop_opcodes(sass: str) -> tuple[int, collections.Counter]:
    """The longest backward branch's body: (instructions, opcodes with their modifiers)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    best: list[str] = []
    for addr, text in ins:
        m = re.search(r"BRA\s+\(?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return len(best), collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in best)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="fp8", choices=("fp8", "fp8_vtok", "bf16"),
                    help="fp8: V dim-major (the engine's); fp8_vtok: V token-major (the earlier layout)")
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--cascade", action="store_true")
    ap.add_argument("--transposed", action="store_true", help="kernels_transposed.py's kernel (fp8 only)")
    ap.add_argument("--out", default=None, help="write the PTX and SASS here")
    a = ap.parse_args()
    import triton
    if a.transposed and a.kv != "fp8":
        raise SystemExit("--transposed: the transposed kernel reads an fp8 cache with V dim-major (--kv fp8)")
    kernel = compile_kernel(a.kv, a.warps, a.stages, a.block_n, a.cascade, a.transposed)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    out = Path(a.out or "/tmp/kernel_sass")
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel.ptx").write_text(kernel.asm["ptx"])
    (out / "kernel.cubin").write_bytes(kernel.asm["cubin"])
    run = lambda *args: subprocess.run([str(tools / "cuobjdump"), *args, str(out / "kernel.cubin")],  # noqa: E731
                                       capture_output=True, text=True, check=True).stdout
    sass = run("-sass")
    (out / "kernel.sass").write_text(sass)
    usage = run("-res-usage").strip().splitlines()[-1].strip()
    num, ops = loop_opcodes(sass)
    print(f"{a.kv}{' transposed' if a.transposed else ''}, {a.warps} warps, {a.stages} stages, block_n "
          f"{a.block_n}{', cascade' if a.cascade else ''}: {usage}")
    regs = int(usage.split("REG:")[1].split()[0])
    print(f"shared memory {kernel.metadata.shared} bytes (Triton's metadata): "
          f"{programs_per_sm(regs, a.warps, kernel.metadata.shared)} programs per multiprocessor")
    print(f"KV-tile loop: {num} instructions per warp")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(24)))


if __name__ == "__main__":
    main()
