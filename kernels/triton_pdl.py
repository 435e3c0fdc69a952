"""The device half of programmatic dependent launch (PDL, Hopper), shared by every Triton kernel of
a decoder layer's chain (kernels/cell_launch.pdl_options gives the host half): a program lets the
next kernel launch now and waits here for the previous one, whose outputs it reads, to finish and
flush. Called before any load of a previous kernel's output, it keeps the kernel's body ordered
exactly as without PDL; what it gains is the launch: the next kernel's programs are resident
before this one ends (the one-token kernels load their first weight tile before it: weights are
constant)."""
import triton
import triton.language as tl


@triton.jit
def wait_for_input(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
