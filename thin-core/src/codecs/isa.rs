//! Which instruction set the CPU matvec kernels run on, picked once per process.
//!
//! Every kernel has a portable loop and, on x86-64, AVX2 and AVX-512 versions; all of them sum in
//! the same order, so they give the same bits and the choice is only about speed. One level above
//! them changes the numbers: with AVX-512 BF16, prefill's bf16 GEMM runs on `vdpbf16ps` (the input
//! split into two bf16 halves, products summed in pairs), within 1e-4 relative of the exact sum
//! (`cpu::gemm_bf16dot`); everything else runs the AVX-512 kernels. The best level the CPU has is
//! used, unless `THIN_CPU_ISA` (`portable`, `avx2`, `avx512` or `avx512bf16`) asks for a lower one
//! (to test or time the fallbacks on a machine that has more, or to keep prefill exact; a higher
//! one than the CPU has is ignored).

use std::sync::OnceLock;

/// A kernel level, in increasing order of what it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2 and F16C (and FMA, which every AVX2 CPU has; the kernels multiply then add).
    Avx2,
    /// AVX-512 F, BW and VL, on top of AVX2.
    Avx512,
    /// AVX-512 BF16 on top of AVX-512: prefill's bf16 GEMM on dot products (not bit-equal).
    Avx512Bf16,
}

const LEVELS: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

impl Isa {
    /// The name `THIN_CPU_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    /// The highest level this CPU runs.
    pub fn detected() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("f16c") && has!("fma") {
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                    return if has!("avx512bf16") { Isa::Avx512Bf16 } else { Isa::Avx512 };
                }
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every level this CPU runs, lowest first (the tests compare them all).
    pub fn supported() -> Vec<Isa> {
        LEVELS.into_iter().filter(|&i| i <= Isa::detected()).collect()
    }

    /// The level the kernels use: the detected one, or the lower one `THIN_CPU_ISA` names.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let detected = Isa::detected();
            let asked = std::env::var("THIN_CPU_ISA").ok().and_then(|v| LEVELS.into_iter().find(|i| i.name() == v));
            asked.map_or(detected, |a| a.min(detected))
        })
    }

    /// The level of the bit-equal kernels to run for `self`: `self` if this CPU runs it, else the
    /// detected level (so a caller can never run an instruction the CPU lacks), and AVX-512 for
    /// AVX-512 BF16 (which only prefill's bf16 GEMM uses: [`Isa::bf16_dot`]).
    pub(crate) fn clamp(self) -> Isa {
        self.min(Isa::detected()).min(Isa::Avx512)
    }

    /// Whether prefill's bf16 GEMM runs on AVX-512 BF16 dot products at this level on this CPU.
    pub(crate) fn bf16_dot(self) -> bool {
        self.min(Isa::detected()) == Isa::Avx512Bf16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_clamped() {
        assert!(Isa::Portable < Isa::Avx2 && Isa::Avx2 < Isa::Avx512 && Isa::Avx512 < Isa::Avx512Bf16);
        assert_eq!(Isa::Portable.clamp(), Isa::Portable);
        assert!(Isa::Avx512.clamp() <= Isa::detected());
        assert!(Isa::Avx512Bf16.clamp() <= Isa::Avx512);
        assert!(!Isa::Avx512.bf16_dot() && !Isa::Portable.bf16_dot());
        assert_eq!(Isa::Avx512Bf16.bf16_dot(), Isa::detected() == Isa::Avx512Bf16);
        assert!(Isa::best() <= Isa::detected());
        assert_eq!(Isa::supported()[0], Isa::Portable);
        assert_eq!(*Isa::supported().last().unwrap(), Isa::detected());
    }
}
