"""Float32 bounds that depend on the CPU's vector width (docs/notes.md, Tolerances).

Two batch layouts of one float32 computation (the zero-waste pass against TRL's full pass, tiles against the whole MLP)
sum in another order; how many ulps apart they land depends on how the CPU's kernels block their sums, which follows
the vector width torch dispatches to. A gap measured on AVX-512 is 2.4e-9 where the same comparison on an AVX2-only CPU
reaches 6e-8, so one bound for both would sit 25x above one kind's gap or fail the other's. Each bound here is measured
on both kinds (torch at 1 and 2 threads, eight input seeds) and set 2.5-4x above the worst gap of its kind.
"""

from __future__ import annotations

import torch

# what torch's CPU kernels use on this machine: "AVX512", "AVX2", "DEFAULT" (no AVX2), or an ARM/other name
CPU_KERNELS = torch.backends.cpu.get_cpu_capability()


def float32_bound(*, avx512: float, avx2: float) -> float:
    """`avx512` where torch runs AVX-512 kernels, else `avx2` (measured on AVX2, the only other kind measured)."""
    return avx512 if CPU_KERNELS.startswith("AVX512") else avx2
