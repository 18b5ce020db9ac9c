"""gpu_check/sass_count.py's path finder on a small hand-written disassembly (the compile needs nvcc and
minutes; the reading of its output is what can go wrong silently)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gpu_check/
import sass_count  # noqa: E402

# a kernel: a branch whose taken side is common (two adds) and whose other side is a cold line and a call
# to a slow path, then a loop of two passes over a body with a cold store, then the exit
DIS = """
	.text._Z4stepPf:
        //## File "/src/k.cu", line 10
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;
        /*0020*/              @P0 BRA `(.L_x_1) ;
        //## File "/src/k.cu", line 20
        /*0030*/                   FADD R2, R2, R3 ;
        /*0040*/                   CALL.REL.NOINC `($_Z4stepPf$slow) ;
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_1:
        //## File "/src/k.cu", line 11 inlined at "/src/k.cu", line 30
        /*0060*/                   FADD R2, R2, R4 ;
        /*0070*/                   FADD R2, R2, R4 ;
.L_x_2:
        //## File "/src/k.cu", line 12
        /*0080*/                   IADD3 R5, R5, 0x1, RZ ;
        //## File "/src/k.cu", line 21
        /*0090*/                   STG.E [R6.64], R2 ;
        //## File "/src/k.cu", line 13
        /*00a0*/                   ISETP.GE.AND P1, PT, R5, R7, PT ;
        //## File "/src/k.cu", line 40
        /*00b0*/             @!P1 BRA `(.L_x_2) ;
        //## File "/src/k.cu", line 14
        /*00c0*/                   EXIT ;
"""
COLD = {"/src/k.cu": {20, 21}}


def test_functions_reads_instructions_labels_and_inlined_lines():
    fns = sass_count.functions(DIS)
    instrs = fns["_Z4stepPf"]
    assert len(instrs) == 13
    assert instrs[2].op == "BRA" and instrs[2].guarded and instrs[2].target == ".L_x_1"
    assert instrs[6].label == ".L_x_1"
    assert instrs[6].where == [("/src/k.cu", 11), ("/src/k.cu", 30)]
    assert instrs[4].op == "CALL"


def test_whole_function_takes_the_common_side_and_counts_the_loop_body_once():
    instrs = sass_count.functions(DIS)["_Z4stepPf"]
    path = sass_count.common_path(instrs, COLD, None)
    assert [i.addr for i in path] == [0x00, 0x10, 0x20, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0]


def test_a_loop_line_limits_the_path_to_one_pass_of_its_body():
    instrs = sass_count.functions(DIS)["_Z4stepPf"]
    path = sass_count.common_path(instrs, COLD, ("k.cu", 40))
    assert [i.addr for i in path] == [0x80, 0x90, 0xA0, 0xB0]
    assert sum(1 for i in path if any(n in COLD["/src/k.cu"] for _, n in i.where)) == 1


def test_cold_lines_take_a_blocks_lines_and_a_line_alone(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text("int a;\nif (corr != nullptr) {\n  x = 1;\n  y = 2;\n}\nz = 3;\n"
                   "b[i] = i < cnt ? elem_bits(p[i]) : 0u;\n")
    assert sass_count.cold_lines(str(src)) == {3, 4, 5, 7}


def test_sources_keeps_only_the_rules_asked_for(tmp_path):
    csrc = sass_count.sources(None, str(tmp_path), ["adamw"])
    text = open(os.path.join(csrc, "includes", "q8_rules.h")).read()
    line = next(l for l in text.split("\n") if l.startswith("#define Q8_RULES(X)"))
    assert '"adamw"' in line and '"adam"' not in line and '"lion"' not in line


def test_a_fixed_rounding_makes_each_states_mode_a_constant(tmp_path):
    csrc = sass_count.sources(None, str(tmp_path), ["adamw"], "tree_guided")
    sass_count.fix_rounding(csrc, "guided")
    text = open(os.path.join(csrc, "cuda", "q8_cuda_step.cuh")).read()
    assert "list.rounding_modes[k]" not in text
    assert "const int listed = 3;" in text  # Q8_ROUND_BY_OLD_CODE
    with pytest.raises(SystemExit, match="no such rounding mode"):  # already fixed: nothing left to fix
        sass_count.fix_rounding(csrc, "stochastic")
    with pytest.raises(SystemExit, match="must be one of"):
        sass_count.measure("tree@sometimes", "90", ["adamw"], ".", str(tmp_path))


def test_through_stochastic_makes_the_guided_requantization_cold(tmp_path):
    csrc = sass_count.sources(None, str(tmp_path), ["adamw"])
    path = os.path.join(csrc, "cuda", "q8_cuda_step.cuh")
    lines = open(path).read().split("\n")
    guided = [i for i, l in enumerate(lines, start=1) if "requantize_guided_code<true>(t, x" in l]
    assert guided, "the step kernel no longer calls requantize_guided_code as GUIDED_COLD expects"
    plain, through = sass_count.cold_lines(path), sass_count.cold_lines(path, sass_count.GUIDED_COLD)
    assert plain < through and all(i in through and i not in plain for i in guided)
    # the stochastic requantization stays on the path either way
    stochastic = [i for i, l in enumerate(lines, start=1) if "requantize_stochastic<true>(t, x" in l]
    assert stochastic and not any(i in through for i in stochastic)


def test_through_correction_makes_the_correction_bytes_common(tmp_path):
    csrc = sass_count.sources(None, str(tmp_path), ["adamw"])
    path = os.path.join(csrc, "cuda", "q8_cuda_load_store.cuh")
    lines = open(path).read().split("\n")
    joins = [i for i, l in enumerate(lines, start=1) if "q8_bf16_join(" in l and "corr[i]" in l]
    assert joins, "load_param8 no longer joins the correction bytes as CORRECTION expects"
    plain = sass_count.cold_lines(path)
    through = sass_count.cold_lines(path, (), [sass_count.CORRECTION])
    assert all(i in plain and i not in through for i in joins)
