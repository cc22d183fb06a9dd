//! Which instruction set the CPU matvec kernels run on, picked once per process.
//!
//! Every kernel has a portable loop and, on x86-64, AVX2 and AVX-512 versions; all of them sum in
//! the same order, so they give the same bits and the choice is only about speed. One level above
//! them, AVX-512 dot products, changes the numbers, within 1e-4 relative of the exact sum: with
//! AVX-512 BF16, prefill's bf16 GEMM runs on `vdpbf16ps` (the input split into two bf16 halves,
//! products summed in pairs; `cpu::gemm_bf16dot`), and with AVX-512 VNNI, Q8_0 decode runs on
//! `vpdpbusd` (the input as 24-bit integers per block; `q8_0::IntX`); everything else runs the
//! AVX-512 kernels. The best level the CPU has is used, unless `THIN_CPU_ISA` (`portable`, `avx2`,
//! `avx512` or `avx512dot`) asks for a lower one (to test or time the fallbacks on a machine that
//! has more, or to keep every kernel exact; a higher one than the CPU has is ignored).

use std::sync::OnceLock;

/// Whether this CPU has the x86-64 feature named (false on other architectures).
macro_rules! cpu_has {
    ($feature:tt) => {{
        #[cfg(target_arch = "x86_64")]
        let has = std::arch::is_x86_feature_detected!($feature);
        #[cfg(not(target_arch = "x86_64"))]
        let has = false;
        has
    }};
}

/// A kernel level, in increasing order of what it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2 and F16C (and FMA, which every AVX2 CPU has; the kernels multiply then add).
    Avx2,
    /// AVX-512 F, BW and VL, on top of AVX2.
    Avx512,
    /// AVX-512 BF16 or VNNI (or both) on top of AVX-512: prefill's bf16 GEMM and Q8_0 decode on
    /// dot-product instructions, as far as the CPU has them (not bit-equal).
    Avx512Dot,
}

const LEVELS: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Dot];

impl Isa {
    /// The name `THIN_CPU_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Dot => "avx512dot",
        }
    }

    /// The highest level this CPU runs.
    pub fn detected() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("f16c") && has!("fma") {
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                    return if has!("avx512bf16") || has!("avx512vnni") { Isa::Avx512Dot } else { Isa::Avx512 };
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
    /// AVX-512 dot products (which only the [`Isa::bf16_dot`] and [`Isa::int8_dot`] kernels use).
    pub(crate) fn clamp(self) -> Isa {
        self.min(Isa::detected()).min(Isa::Avx512)
    }

    /// Whether prefill's bf16 GEMM runs on AVX-512 BF16 dot products at this level on this CPU.
    pub(crate) fn bf16_dot(self) -> bool {
        self.min(Isa::detected()) == Isa::Avx512Dot && cpu_has!("avx512bf16")
    }

    /// Whether Q8_0 decode runs on AVX-512 VNNI integer dot products at this level on this CPU.
    pub(crate) fn int8_dot(self) -> bool {
        self.min(Isa::detected()) == Isa::Avx512Dot && cpu_has!("avx512vnni")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_clamped() {
        assert!(Isa::Portable < Isa::Avx2 && Isa::Avx2 < Isa::Avx512 && Isa::Avx512 < Isa::Avx512Dot);
        assert_eq!(Isa::Portable.clamp(), Isa::Portable);
        assert!(Isa::Avx512.clamp() <= Isa::detected());
        assert!(Isa::Avx512Dot.clamp() <= Isa::Avx512);
        assert!(!Isa::Avx512.bf16_dot() && !Isa::Portable.bf16_dot() && !Isa::Avx512.int8_dot());
        let dot = Isa::detected() == Isa::Avx512Dot;
        assert_eq!(Isa::Avx512Dot.bf16_dot() || Isa::Avx512Dot.int8_dot(), dot);
        assert!(Isa::best() <= Isa::detected());
        assert_eq!(Isa::supported()[0], Isa::Portable);
        assert_eq!(*Isa::supported().last().unwrap(), Isa::detected());
    }
}
