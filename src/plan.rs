//! `thin plan`: where an archive's weights would live on the GPU, printed before anything is
//! allocated (and without a GPU: the budget is then unknown unless `--gpu-mem` gives it).

use std::path::Path;

use anyhow::Context;
use thin::{Budget, HostRate, Link, LinkSource, Residency, ResidencyError};
use thin_core::format::Archive;

pub struct PlanOptions {
    pub gpu_mem: Option<u64>,
    pub ctx: Option<usize>,
    pub link_gb_s: Option<f64>,
    /// The CPU engine's rate for `hybrid` (measured when not given).
    pub host_gb_s: Option<f64>,
    pub json: bool,
    pub residency: thin::Residency,
}

/// `--link-gb-s X`: a positive, finite number of GB/s.
pub fn parse_link_gb_s(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a positive number of GB/s")),
    }
}

pub fn plan(file: &Path, opts: &PlanOptions) -> anyhow::Result<()> {
    let a = Archive::open(file).with_context(|| format!("opening {}", file.display()))?;
    let m = a.manifest();
    let ctx = opts.ctx.unwrap_or(thin::DEFAULT_CTX.min(m.arch.max_position_embeddings.max(1) as usize));
    let budget = Budget { gpu_mem: opts.gpu_mem, free: thin::free_device_bytes() };
    let link = opts.link_gb_s.map_or_else(Link::default, |gb_s| Link { gb_s, source: LinkSource::Given });
    let arch = thin_generated::arch_name(&m.shape_fingerprint).unwrap_or("?");
    let host = match (opts.host_gb_s, opts.residency) {
        (Some(gb_s), _) => HostRate { gb_s, source: LinkSource::Given },
        (None, Residency::Hybrid) => thin::host_rate(&a).with_context(|| format!("timing the CPU engine on {}", file.display()))?,
        (None, _) => HostRate::default(),
    };
    let (plan, refusal) = match thin::residency_plan_with_host(&a, ctx, budget, link, host, opts.residency) {
        Ok(p) => (p, None),
        Err(thin::Error::Residency(e @ ResidencyError::DoesNotFit { .. })) => {
            let ResidencyError::DoesNotFit { plan, .. } = &e else { unreachable!() };
            (plan.as_ref().clone(), Some(e))
        }
        Err(e) => return Err(e).with_context(|| format!("planning {}", file.display())),
    };
    if opts.json {
        let mut v = serde_json::to_value(&plan)?;
        v["arch"] = arch.into();
        v["profile"] = m.quantization.method.clone().into();
        v["fits"] = refusal.is_none().into();
        v["error"] = refusal.as_ref().map(|e| e.to_string()).into();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{}: {arch}, {} profile, ctx {ctx}", file.display(), m.quantization.method);
        print!("{}", plan.table());
    }
    match refusal {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}
