"""SASS instructions per element of the CUDA step kernels, read from the compiled op (no GPU needed).

Compiles the op's CUDA files for one architecture (default sm_90) with the op's own nvcc flags plus
``-lineinfo``, from a copy of the sources whose ``Q8_RULES`` names only the rules asked for (a build of a
minute instead of several), disassembles them with ``nvdisasm`` and counts, for each step kernel, the
instructions a warp issues along the common path through one pass of its threads (8 elements each): a
whole tile of 16-byte aligned tensors, finite values, stochastic rounding of the states, no correction
bytes, no telemetry, blocks of 64 (T = 8 threads, no shared-memory reduction), none of the division or
square-root slow paths.

The path is found on the kernel's control-flow graph, its back edges cut: of the paths from the pass's
first instruction to its last (for a persistent kernel, one iteration of its tile loop), the one with
the most instructions from common source lines less COLD_WEIGHT for each from a line off the common path
(``COLD``, matched by their text, so the same list serves earlier revisions), never through a call to a
slow path. So it takes the longer side of a branch both of whose sides are common (the block's first
thread storing its maximum), and a block that mixes a few instructions of a cold line into common code
(the scheduler interleaves them) stays on it. Counts are issue slots of one warp, whatever its active
lanes; the JSON also counts the path's instructions from cold lines.

``--rev REV`` measures a git revision's sources instead of the working tree's, so one run puts kernels
side by side:

    python gpu_check/sass_count.py                        # this tree, AdamW
    python gpu_check/sass_count.py --rev 103f9e4 --rev tree --json out/sass.json
    python gpu_check/sass_count.py --rev 84d1199@stochastic --rev tree@stochastic --rev tree@guided
    python gpu_check/sass_count.py --rev 84d1199 --rev tree --through stochastic   # what state_rounding="stochastic" runs
    python gpu_check/sass_count.py --through correction                  # bf16 parameters with correction bytes
    python gpu_check/sass_count.py --kernels '^void step4_kernel<AdamRule<true>, float, float>'   # the 4-bit kernel

Besides the instructions, each row gives per element the path's shared-memory loads (LDS) and global loads
(LDG, and LD through a generic pointer, which the kernels' tensors are), and the kernel's registers, spills and
static shared memory (ptxas); the 8-bit kernel of table maps adds a FloorTable (26,640 bytes) of dynamic
shared memory per table map at launch.

A static count over one path, not a measurement: Nsight Compute on a GPU counts what runs
(gpu_check/gpu_check.sh's profile stage).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "gpu_check"))
import ptxas_report  # noqa: E402

CSRC = "ds_q8/csrc"
ELEMS = 8  # elements per thread and pass (kElems)
COLD_WEIGHT = 20  # a path's score: common instructions, less this for each off the common path

#: Source text off the common path, and whether the line alone is ("line") or the block its braces open
#: ("block": the lines after it, up to its closing brace; the condition itself runs on the common path).
COLD = [
    ("if (corr != nullptr) {", "block"),                       # bf16 correction bytes
    ("if (a.error_sums != nullptr) {", "block"),               # quantization telemetry
    ("const uint2 r = reinterpret_cast<const uint2*>(p)[j];", "line"),  # 8-, 4- and 1-byte aligned views
    ("reinterpret_cast<uint2*>(p)[j] = make_uint2(", "line"),
    ("for (int j = 0; j < kWords; ++j) w[j] = reinterpret_cast<const uint32_t*>(p)[j];", "line"),
    ("for (int j = 0; j < kWords; ++j) reinterpret_cast<uint32_t*>(p)[j] = w[j];", "line"),
    ("b[i] = i < cnt ? elem_bits(p[i]) : 0u;", "line"),        # a tensor's last, partial pass
    ("if (i < cnt) p[i] = elem_from_bits<T>(b[i]);", "line"),
    ("c[i] = i < cnt ? (uint32_t)(p[i / 2]", "line"),
    ("if (2 * j < cnt) p[j] = (uint8_t)", "line"),
    ("Q8_HD uint32_t q8_quantize_scaled(float y, const uint32_t* lookup) {", "block"),  # the lookup table
    ("return q8_quantize_scaled(y, lookup);", "line"),         # the segment search's ambiguous values
    ("round_exact(", "line"),                                  # blocks that are not finite
    ("__device__ __forceinline__ uint32_t round_exact(", "block"),
    ("round_nearest_by_table(", "line"),                       # state_rounding="nearest"
    ("const int warp = threadIdx.x / 32, warps = T / 32, first = (threadIdx.x / T) * warps;", "line"),  # T > 32
    ("if ((threadIdx.x & 31) == 0) red[warp] = local;", "line"),
    ("for (int w = 1; w < warps; ++w)", "line"),
    ("__syncthreads();  // `red` is reused by the next reduction", "line"),
    ("if (tile >= end) {  // the CTA's first tile of a tensor", "block"),  # once per tensor, not per tile
    ("if (!__all_sync(0xFFFFFFFFu, ", "block"),                   # a division or root off its fast path
    ("mf_encode8_exact(", "line"),                                  # blocks far out of range, not finite
    ("__device__ __forceinline__ void mf_encode8_exact(", "block"),
    ("if (i < cnt) w[i >> 2] |= (uint32_t)p[i] << (8 * (i & 3));", "line"),  # codes of a partial pass
    ("if (i < cnt) p[i] = (uint8_t)(w[i >> 2] >> (8 * (i & 3)));", "line"),
]

#: --through stochastic: the run-time kernel's path through stochastic rounding, the guided roundings'
#: requantization (which the path would otherwise take, being the longest) counted as cold. The default's
#: own kernel (kGuided) has no such path; revisions before guided rounding match none of these lines.
GUIDED_COLD = [
    ("requantize_guided<true>(", "line"), ("requantize_guided<false>(", "line"),
    ("requantize_guided_code<true>(", "line"), ("requantize_guided_code<false>(", "line"),
    ("(positive || !kKeepPrev) && (mode == Q8_ROUND_GUIDED || !fast)) {", "block"),
]

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


#: --rev's "@rounding": each state's requantization fixed at compile time, so that the common path is that
#: rule's alone (without it the path takes the longest of the kernel's rules); "guided" is the default's,
#: every state guided by its old code, and "guided_update" the default before it (signed states guided by
#: their update, unsigned ones by their old code; revisions up to f873092, whose kernels still had it)
ROUNDINGS = {"stochastic": ("Q8_ROUND_STOCHASTIC", "true"), "nearest": ("Q8_ROUND_NEAREST", "false"),
             "guided": ("3", None),  # Q8_ROUND_BY_OLD_CODE, named Q8_ROUND_GUIDED_CODE before
             "guided_update": ("((Rule::kSigned >> k) & 1u) ? Q8_ROUND_GUIDED : Q8_ROUND_GUIDED_CODE", None)}
#: the line that reads a state's mode, in this revision (rounding_modes) and in older ones (stochastic_states)
_MODE_LINES = tuple(line.format(field) for field in ("rounding_modes", "stochastic_states")
                    for line in ("const int listed = list.{}[k];", "const int mode = list.{}[k];",
                                 "const bool sr = list.{}[k];"))


def fix_rounding(csrc: str, rounding: str) -> None:
    """Make the step kernel's per-state rounding mode ``rounding`` (ROUNDINGS) a compile-time constant."""
    path = os.path.join(csrc, "cuda", "q8_cuda_step.cuh")
    text = open(path).read()
    for line in _MODE_LINES:
        value = ROUNDINGS[rounding][0 if line.startswith("const int") else 1]
        if line in text and value is not None:
            open(path, "w").write(text.replace(line, line.split("=")[0] + f"= {value};"))
            return
    raise SystemExit(f"@{rounding}: this revision's step kernel has no such rounding mode to fix")


def sources(rev: Optional[str], dest: str, rules: List[str], label: Optional[str] = None) -> str:
    """A copy of csrc (of ``rev``, or the working tree) whose Q8_RULES names only ``rules``."""
    out = os.path.join(dest, label or rev or "tree")
    if rev:
        os.makedirs(out)
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev, CSRC], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    else:
        shutil.copytree(os.path.join(ROOT, CSRC), os.path.join(out, CSRC))
    # Q8_RULES is in q8_rules.h; revisions before that header have it in q8_common.h
    common = os.path.join(out, CSRC, "includes", "q8_rules.h")
    if not os.path.exists(common):
        common = os.path.join(out, CSRC, "includes", "q8_common.h")
    text = open(common).read()
    start = text.index("#define Q8_RULES(X)")
    end = text.index("}  // namespace ds_q8", start)
    entries = re.findall(r'X\("([^"]+)",\s*([^)]*\)?)\)', text[start:end])
    wanted = [f'X("{n}", {t})' for n, t in entries if n in rules]
    if not wanted:
        raise SystemExit(f"no rule of {rules} in Q8_RULES ({[n for n, _ in entries]})")
    with open(common, "w") as f:
        f.write(text[:start] + "#define Q8_RULES(X) " + " ".join(wanted) + "\n\n" + text[end:])
    return os.path.join(out, CSRC)


def tool(name: str) -> str:
    """A CUDA binary tool from the toolkit, or the copy the triton package carries."""
    found = shutil.which(name) or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)
    if os.path.exists(found):
        return found
    try:
        import triton

        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        if os.path.exists(cand):
            return cand
    except ImportError:
        pass
    raise SystemExit(f"{name} not found: install the CUDA toolkit's, or triton (which carries it)")


def disassemble(csrc: str, arch: str, tmp: str) -> Tuple[str, str]:
    """nvdisasm -gi of every CUDA file of ``csrc`` compiled with line info; (disassembly, ptxas log)."""
    folder = os.path.join(csrc, "cuda")
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".cu"))
    rc, log, objects = ptxas_report.compile_all(arch, tmp, files, includes=[os.path.join(csrc, "includes")],
                                                extra=["-lineinfo"])
    if rc != 0:
        raise SystemExit(log[-6000:])
    text = []
    for obj in objects:
        folder = obj + ".elf"
        os.makedirs(folder)
        subprocess.run([tool("cuobjdump"), "-xelf", "all", obj], cwd=folder, capture_output=True, check=True)
        for cubin in sorted(os.listdir(folder)):
            text.append(subprocess.run([tool("nvdisasm"), "-gi", "-c", os.path.join(folder, cubin)],
                                       capture_output=True, text=True, check=True).stdout)
    return "\n".join(text), log


#: --through correction: bf16 parameters with correction bytes (correction_byte=True), their lines common
CORRECTION = ("if (corr != nullptr) {", "block")


def cold_lines(path: str, extra: Sequence[Tuple[str, str]] = (), common: Sequence[Tuple[str, str]] = ()) -> set:
    """Line numbers of ``path`` that are off the common path (COLD less ``common``, and ``extra`` of the same form)."""
    lines = open(path).read().split("\n")
    cold = set()
    for i, text in enumerate(lines, start=1):
        for snippet, kind in [c for c in COLD if c not in common] + list(extra):
            if snippet not in text:
                continue
            if kind == "line":
                cold.add(i)
                continue
            depth, j = text.count("{") - text.count("}"), i
            while depth > 0 and j < len(lines):
                cold.add(j + 1)
                depth += lines[j].count("{") - lines[j].count("}")
                j += 1
    return cold


class Instr:
    __slots__ = ("addr", "text", "where", "label")

    def __init__(self, addr, text, where, label):
        self.addr, self.text, self.where, self.label = addr, text, where, label

    @property
    def op(self) -> str:
        t = self.text.split()
        return (t[1] if t[0].startswith("@") else t[0]).split(".")[0]

    @property
    def guarded(self) -> bool:
        return self.text.startswith("@") and not self.text.startswith("@PT")

    @property
    def target(self) -> Optional[str]:
        m = _TARGET.search(self.text)
        return m.group(1) if m else None


def functions(dis: str) -> Dict[str, List[Instr]]:
    """The instructions of each function in nvdisasm -gi output, each with every source line of its
    inlining chain (a run of line comments before an instruction holds for the ones after it)."""
    out: Dict[str, List[Instr]] = {}
    current, where, pending, label = None, [], [], None
    for line in dis.split("\n"):
        m = re.match(r"^\s*\.text\.(\S+):$", line)
        if m:
            current = m.group(1)
            out[current] = []
            where, pending = [], []
            continue
        if "//## File" in line:
            pending += [(f, int(n)) for f, n in re.findall(r'(?:File|inlined at) "([^"]+)", line (\d+)', line)]
            continue
        m = _LABEL.match(line.strip())
        if m:
            label = m.group(1)
            continue
        m = _INSTR.search(line)
        if m and current is not None:
            if pending:
                where, pending = pending, []
            out[current].append(Instr(int(m.group(1), 16), m.group(2), where, label))
            label = None
    return out


def blocks(instrs: List[Instr]) -> List[Tuple[int, int]]:
    """Basic blocks as [start, end) index ranges."""
    starts = {0}
    for k, ins in enumerate(instrs):
        if ins.label:
            starts.add(k)
        if ins.op in ("BRA", "EXIT", "RET", "JMP", "BRX") and k + 1 < len(instrs):
            starts.add(k + 1)
    s = sorted(starts)
    return [(a, b) for a, b in zip(s, s[1:] + [len(instrs)])]


def is_cold(ins: Instr, cold: Dict[str, set]) -> bool:
    """Whether an instruction comes from a cold line. A reconvergence point (BSYNC) is on every path through its
    branch, whichever side's last line the compiler gives it, so it never is."""
    return ins.op != "BSYNC" and any(line in cold.get(f, ()) for f, line in ins.where)


def common_path(instrs: List[Instr], cold: Dict[str, set], loop_line: Optional[Tuple[str, int]]) -> List[Instr]:
    """The instructions of one pass along the common path (see the module's doc)."""
    bl = blocks(instrs)
    block_of = {a: i for i, (a, _) in enumerate(bl)}
    by_label = {ins.label: k for k, ins in enumerate(instrs) if ins.label}

    def succ(i: int) -> List[int]:
        a, b = bl[i]
        last = instrs[b - 1]
        out = []
        if last.op in ("BRA", "JMP") and last.target in by_label:
            out.append(block_of[by_label[last.target]])
            if not last.guarded:
                return out
        if last.op in ("EXIT", "RET") and not last.guarded:
            return out
        if b < len(instrs):
            out.append(i + 1)
        return out

    def score(i: int) -> int:
        """Instructions on common source lines, less COLD_WEIGHT for each on a cold one; a slow path's call
        rules its block out."""
        a, b = bl[i]
        n_cold = sum(1 for ins in instrs[a:b] if is_cold(ins, cold))
        calls = any(ins.op == "CALL" for ins in instrs[a:b])
        return (b - a - n_cold) - COLD_WEIGHT * n_cold - (10 ** 6 if calls else 0)

    # the pass: the tile loop's body (entered at its back edge's target), or the whole function
    start, stop = 0, None
    if loop_line is not None:
        for k, ins in enumerate(instrs):
            if ins.op == "BRA" and ins.target in by_label and by_label[ins.target] < k and \
                    any(os.path.basename(f) == loop_line[0] and n == loop_line[1] for f, n in ins.where):
                head = by_label[ins.target]
                if stop is None or head < start:
                    start, stop = head, k
    first = block_of[start]
    last = None if stop is None else max(i for i, (a, b) in enumerate(bl) if a <= stop < b)
    best: Dict[int, Tuple[int, Optional[int]]] = {first: (score(first), None)}
    for i in range(first, len(bl)):  # blocks in address order: a DAG once back edges are cut
        if i not in best or (last is not None and i == last):
            continue
        for j in succ(i):
            if j <= i or (last is not None and j > last):
                continue
            cand = best[i][0] + score(j)
            if j not in best or cand > best[j][0]:
                best[j] = (cand, i)
    if last is None:  # the whole function: to its best exit
        exits = [i for i in best if instrs[bl[i][1] - 1].op == "EXIT" and not instrs[bl[i][1] - 1].guarded]
        last = max(exits, key=lambda i: best[i][0])
    path, i = [], last
    while i is not None:
        a, b = bl[i]
        path = instrs[a:b] + path
        i = best[i][1]
    return path


def loop_line_of(csrc: str) -> Optional[Tuple[str, int]]:
    """(file, line) of the persistent kernels' tile loop, if the sources have one."""
    for dirpath, _, names in os.walk(csrc):
        for name in names:
            if name.endswith((".cu", ".cuh", ".h")):
                for n, text in enumerate(open(os.path.join(dirpath, name)).read().split("\n"), start=1):
                    if "tile += (int)gridDim.x" in text:
                        return name, n
    return None


def measure(spec: str, arch: str, rules: List[str], match: str, tmp: str, through: Optional[str] = None) -> List[Dict]:
    """The rows of ``spec``: a git revision or "tree", with "@rounding" to fix the rounding (ROUNDINGS);
    ``through="stochastic"``: the path through stochastic rounding (GUIDED_COLD); ``through="correction"``: the
    path through the correction bytes of bf16 parameters (CORRECTION)."""
    name, _, rounding = spec.partition("@")
    if rounding and rounding not in ROUNDINGS:
        raise SystemExit(f"--rev {spec!r}: the rounding after '@' must be one of {sorted(ROUNDINGS)}")
    rev = None if name == "tree" else name
    label = re.sub(r"[^\w.-]", "_", spec)
    csrc = sources(rev, tmp, rules, label)
    if rounding:
        fix_rounding(csrc, rounding)
    objects = os.path.join(tmp, f"{label}-objects")
    os.makedirs(objects)
    dis, log = disassemble(csrc, arch, objects)
    regs = {r["mangled"]: r for r in ptxas_report.parse(log)}
    cold: Dict[str, set] = {}
    for dirpath, _, names in os.walk(csrc):
        for name in names:
            if name.endswith((".cu", ".h", ".cuh")):
                path = os.path.join(dirpath, name)
                cold[path] = cold_lines(path, GUIDED_COLD if through == "stochastic" else (),
                                        [CORRECTION] if through == "correction" else ())
    loop = loop_line_of(csrc)
    rows = []
    for mangled, instrs in functions(dis).items():
        name = ptxas_report.short_name(mangled)
        if not re.search(match, name) or not instrs:
            continue
        path = common_path(instrs, cold, loop)
        r = regs.get(mangled, {})
        on_cold = sum(1 for i in path if is_cold(i, cold))
        ops = Counter(i.op for i in path)
        rows.append({"rev": spec, "kernel": name, "static": len(instrs), "path": len(path), "cold": on_cold,
                     "per_element": round(len(path) / ELEMS, 1), "registers": r.get("registers"),
                     "spills": r.get("spill_stores", 0) + r.get("spill_loads", 0), "smem": r.get("smem"),
                     "lds_per_element": round(ops["LDS"] / ELEMS, 2),
                     "ldg_per_element": round((ops["LDG"] + ops["LD"]) / ELEMS, 2),
                     "ops": dict(ops.most_common())})
    return sorted(rows, key=lambda r: r["kernel"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", help="a git revision to measure, or tree for the working tree, with "
                    "@stochastic, @nearest or @guided to fix each state's rounding (repeatable; default: tree)")
    ap.add_argument("--arch", default="90", help="compute capability without the dot (default 90)")
    ap.add_argument("--rules", default="adamw", help="comma-separated rules to compile (default adamw)")
    ap.add_argument("--kernels", default=r"^void step_kernel<AdamRule<true>, (float, float|q8_bf16, q8_bf16)(, \w+)?>",
                    help="regular expression on the demangled kernel names to report")
    ap.add_argument("--through", choices=["stochastic", "correction"], help="stochastic: in kernels that read the "
                    "rounding at run time, count the path through stochastic rounding (the guided roundings' lines "
                    "cold); correction: the path of bf16 parameters with correction bytes")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"\d{2,3}", args.arch):
        ap.error(f"--arch must be a compute capability such as 90 or 80, got {args.arch!r}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rev in args.rev or ["tree"]:
            rows += measure(rev, args.arch, args.rules.split(","), args.kernels, tmp, args.through)
    if not rows:
        print(f"no kernel matches {args.kernels!r}", file=sys.stderr)
        return 1
    width = max(len(r["kernel"]) for r in rows)
    print(f"| revision | kernel{' ' * (width - 6)} | registers | spills | smem | SASS | common path | per element "
          f"| LDS/el | LDG/el |")
    print(f"|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rev'][:24]} | {r['kernel']:<{width}} | {r['registers']} | {r['spills']} | {r['smem']} | "
              f"{r['static']} | {r['path']} | {r['per_element']} | {r['lds_per_element']} | {r['ldg_per_element']} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "through": args.through, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
