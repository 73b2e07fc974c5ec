"""benchmarks/tools/sass_spills.py's loop finder on a hand-written SASS listing (nvdisasm -c's format)."""

from benchmarks.tools.sass_spills import loops, opcode

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x36420], R0 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_2:
        /*0030*/                   LDL.64 R206, [R1+0x70] ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R152, gdesc[UR56], RZ, !UPT ;
        /*0050*/                   MUFU.EX2 R2, R0 ;
        /*0060*/                   STL [R1], R2 ;
        /*0070*/              @P0 LDL R8, [R1+0x154] ;
""" + "".join(f"        /*{0x80 + 16 * k:04x}*/                   FADD R{k}, R{k}, R{k} ;\n" for k in range(12)) + """
        /*0140*/               @P1 BRA `(.L_x_2) ;
        /*0150*/                   EXIT ;
.L_x_9:
        /*0160*/                   BRA `(.L_x_1) ;
.L_x_3:
        /*0170*/                   NOP ;
        /*0180*/              @!P0 BRA `(.L_x_3) ;
"""


def test_loops_are_conditional_backward_branches_with_their_counts():
    """The key loop (a conditional branch back to .L_x_2) is found with its local stores and loads
    (predicated ones too), wgmmas and exp2s; the unconditional wait-retry branch back from after the
    code and the two-instruction spin loop are not loops."""
    rows = loops(SASS)
    assert rows == [dict(start=0x30, end=0x140, size=18, stl=1, ldl=2, hgmma=1, ex2=1)]
    assert opcode("@P0 LDL R8, [R1+0x154] ;") == "LDL" and opcode("LDL.64 R206, [R1] ;") == "LDL.64"
