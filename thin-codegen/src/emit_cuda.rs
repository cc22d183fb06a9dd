//! The `cuda` submodule of a generated engine: the arch's shapes, the schedule derived from its
//! plan (`schedule.rs`) and the kernel sources, as the CUDA runtime takes them.

use proc_macro2::TokenStream;
use quote::quote;

use crate::description::*;
use crate::emit_cpu::{inv_freq_tokens, lit_u};
use crate::lower::Plan;
use crate::schedule::{schedule_tokens, ScheduleParts, Unsupported};

/// The `cuda` submodule: plain data, so it builds with or without the `cuda` feature. An arch the
/// kernels cannot run gets `arch()` returning the refusal (and no kernel sources).
pub fn emit_cuda_module(d: &Description, plan: &Plan, schedule: &Result<ScheduleParts, Unsupported>) -> TokenStream {
    let a = &d.attention;
    let u = |x: u64| lit_u(x);
    let hd = u(a.head_dim);
    let max_pos = u(d.dims.max_position_embeddings);
    let inv = |t: f64| inv_freq_tokens(d, t, hd.clone());
    let (inv_g, inv_l) = (inv(d.rope.theta), inv(d.rope.local_theta.unwrap_or(d.rope.theta)));
    let body = schedule_tokens(&d.model.name, plan, schedule);
    let arch = if schedule.is_ok() {
        quote! {
            pub const KERNELS: &str = include_str!("kernels/decode.cu");
            /// This arch on the CUDA backend.
            pub fn arch() -> Result<CudaArch, PlanError> {
                Ok(CudaArch {
                    arch: super::ARCH,
                    fingerprint: super::SHAPE_FINGERPRINT,
                    dims: super::DIMS,
                    max_positions: #max_pos,
                    inv_freq_global: #inv_g,
                    inv_freq_local: #inv_l,
                    schedule: schedule()?,
                    kernels: KERNELS,
                })
            }
        }
    } else {
        quote! {
            /// This arch on the CUDA backend: refused (see [`schedule`]).
            pub fn arch() -> Result<CudaArch, PlanError> {
                Err(schedule().err().expect("the schedule is refused"))
            }
        }
    };
    quote! {
        /// This engine on the CUDA backend: its forward pass as kernel launches, derived by
        /// thin-codegen from the same plan the CPU engine above follows.
        pub mod cuda {
            use thin_core::cuda::plan::{Arg, Buf, CudaArch, Gemm, Grid, LayerSteps, Launch, PlanError, RopeTable, Schedule, Step};
            use thin_core::role::Role;

            #body

            #arch
        }
    }
}
