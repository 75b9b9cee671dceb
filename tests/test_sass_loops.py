"""scripts/sass_loops.py on cuobjdump text: the loops of a kernel and their opcodes.

The loop below is copied from the H200's `scripts/device_run.sh sass` output (a quant_gemv kernel's
reduction loop; CUDA 13's cuobjdump names branch targets by address); the forward branch, EXIT and
idle loop around it and the older label form (`.L_x_N:` / `` `(.L_x_N) ``) are written to match.
"""

from __future__ import annotations

import gzip
import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_loops.py"

# The reduction loop (0x3a40 .. its backward branch at 0x3af0) with the encodings cuobjdump prints
# under each instruction; around it a forward branch and the trailing `BRA .` idle loop.
ADDRESS_FORM = """
		Function : _Z6kernelPf
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*3a30*/               @!P1 BRA 0x3b00 ;                                                    /* 0x0000000000309947 */
        /*3a40*/                   LDS R7, [R2+-0x100] ;                                            /* 0xffff000002077984 */
                                                                                                    /* 0x000e620000000800 */
        /*3a50*/                   VIADD R0, R0, 0xffffffff ;                                       /* 0xffffffff00007836 */
                                                                                                    /* 0x000fc60000000000 */
        /*3a60*/                   LDS R6, [R2+-0x80] ;                                             /* 0xffff800002067984 */
                                                                                                    /* 0x000ea40000000800 */
        /*3a70*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;                                /* 0x000000ff0000720c */
                                                                                                    /* 0x000fe40003f05270 */
        /*3a80*/                   LDS R9, [R2] ;                                                   /* 0x0000000002097984 */
                                                                                                    /* 0x000ee80000000800 */
        /*3a90*/                   LDS R8, [R2+0x80] ;                                              /* 0x0000800002087984 */
                                                                                                    /* 0x0008240000000800 */
        /*3aa0*/                   VIADD R2, R2, 0x200 ;                                            /* 0x0000020002027836 */
                                                                                                    /* 0x010fc40000000000 */
        /*3ab0*/                   FADD R10, R7, R10 ;                                              /* 0x0000000a070a7221 */
                                                                                                    /* 0x002fe20000000000 */
        /*3ac0*/                   FADD R5, R6, R5 ;                                                /* 0x0000000506057221 */
                                                                                                    /* 0x004fe20000000000 */
        /*3ad0*/                   FADD R4, R9, R4 ;                                                /* 0x0000000409047221 */
                                                                                                    /* 0x008fe20000000000 */
        /*3ae0*/                   FADD R3, R8, R3 ;                                                /* 0x0000000308037221 */
                                                                                                    /* 0x001fe20000000000 */
        /*3af0*/               @P0 BRA 0x3a40 ;                                                     /* 0xfffffffc00d00947 */
                                                                                                    /* 0x000fec000383ffff */
        /*3b00*/                   EXIT ;                                                           /* 0x000000000000794d */
        /*3b10*/                   BRA 0x3b10;                                                      /* 0xfffffffc00fc7947 */
"""

LABEL_FORM = """
		Function : _Z5otherPf
.L_x_3:
        /*0100*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0110*/                   LOP3.LUT R8, R9, 0xf000f, R10, 0xea, !PT ;
        /*0120*/               @P0 BRA `(.L_x_3) ;
        /*0130*/                   EXIT ;
"""


def _module():
    spec = importlib.util.spec_from_file_location("sass_loops", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_address_form_loop_and_its_opcodes():
    sass_loops = _module()
    (lines,) = sass_loops.functions(ADDRESS_FORM).values()
    (found,) = sass_loops.loops(lines)  # the forward branch and the idle `BRA .` are no loops
    target, start, end, counts = found
    assert target == "0x3a40" and end - start + 1 == 12
    assert counts == {"LDS": 4, "FADD": 4, "VIADD": 2, "ISETP": 1, "BRA": 1}


def test_label_form_loop():
    sass_loops = _module()
    (found,) = sass_loops.loops(sass_loops.functions(LABEL_FORM)["_Z5otherPf"])
    assert found[0] == ".L_x_3" and found[2] - found[1] + 1 == 3
    assert found[3] == {"HMMA": 1, "LOP3": 1, "BRA": 1}


def test_command_line_reads_gzip_and_picks_kernels(tmp_path):
    dump = tmp_path / "sass.txt.gz"
    dump.write_bytes(gzip.compress((ADDRESS_FORM + LABEL_FORM).encode()))
    out = subprocess.run([sys.executable, str(SCRIPT), str(dump), "kernel"], capture_output=True, text=True,
                         check=True).stdout
    assert "_Z6kernelPf" in out and "_Z5otherPf" not in out
    assert "loop 0x3a40: 12 instructions, HMMA 0: LDS 4, FADD 4, VIADD 2, ISETP 1, BRA 1" in out
    missing = subprocess.run([sys.executable, str(SCRIPT), str(dump), "nothing_like_this"], capture_output=True,
                             text=True)
    assert missing.returncode != 0 and "no function matches" in missing.stderr


# A kernel whose early-exit path waits (griddepcontrol.wait is SASS ACQBULK) and whose main path
# loads weights (NA), then waits, then loads the previous kernel's output (STRONG) and a constant.
WAITS = """
		Function : _Z5waitsPf
        /*0000*/               @P0 BRA 0x0040 ;
        /*0010*/                   ACQBULK ;
        /*0020*/                   PREEXIT ;
        /*0030*/                   EXIT ;
        /*0040*/               @!P1 LDG.E.NA.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0050*/                   LDG.E.NA.128.CONSTANT R8, desc[UR4][R2.64+0x10] ;
        /*0060*/                   ACQBULK ;
        /*0070*/                   PREEXIT ;
        /*0080*/                   LDG.E.128.STRONG.GPU R12, desc[UR4][R6.64] ;
        /*0090*/               @P2 LDG.E.U16.CONSTANT R16, desc[UR4][R6.64] ;
        /*00a0*/                   EXIT ;
"""


def test_loads_on_either_side_of_each_wait(tmp_path):
    sass_loops = _module()
    early, main = sass_loops.loads_around_waits(sass_loops.functions(WAITS)["_Z5waitsPf"])
    assert early == (1, {}, {"LDG.E.NA.128.CONSTANT": 2})
    assert main == (6, {"LDG.E.NA.128.CONSTANT": 2}, {"LDG.E.128.STRONG.GPU": 1, "LDG.E.U16.CONSTANT": 1})
    dump = tmp_path / "sass.txt"
    dump.write_text(WAITS)
    out = subprocess.run([sys.executable, str(SCRIPT), str(dump), "waits", "--wait"], capture_output=True, text=True,
                         check=True).stdout
    assert "wait at instruction 6: before LDG.E.NA.128.CONSTANT 2; after LDG.E.128.STRONG.GPU 1, LDG.E.U16.CONSTANT 1" in out
