//! `thin-codegen generate` writes generated/ (only what changed, orphans removed); `thin-codegen
//! check` fails when it is stale or holds files codegen no longer writes; `thin-codegen kernels
//! FILE` prints the CUDA source rendered for any description file (the CPU emulator's checks run
//! kernels at shapes no shipped arch has).
use anyhow::{bail, Context};

fn main() -> anyhow::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cmd = std::env::args().nth(1).unwrap_or_default();
    if cmd == "kernels" {
        let Some(file) = std::env::args().nth(2) else { bail!("usage: thin-codegen kernels FILE.toml") };
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {file}"))?;
        let (_, _, _, sources) = thin_codegen::generate_one_with_kernels(&file, &text).context("codegen failed")?;
        let Some(src) = sources.get("decode.cu") else { bail!("{file}: the CUDA backend refuses this description (no kernels)") };
        print!("{src}");
        return Ok(());
    }
    let files = thin_codegen::generate_all(&root).context("codegen failed")?;
    match cmd.as_str() {
        "generate" => {
            let orphans = thin_codegen::orphan_files(&root, &files);
            let written = thin_codegen::write_files(&root, &files)?;
            println!("{} files: {} rewritten, {} orphans removed", files.len(), written.len(), orphans.len());
            for p in written.iter().chain(&orphans) {
                println!("  {}", p.display());
            }
        }
        "check" => {
            let stale = thin_codegen::stale_files(&root, &files);
            let orphans = thin_codegen::orphan_files(&root, &files);
            if !stale.is_empty() || !orphans.is_empty() {
                bail!("stale: {stale:?}\norphaned: {orphans:?}\nrun: cargo run -p thin-codegen -- generate");
            }
        }
        _ => bail!("usage: thin-codegen generate|check|kernels FILE.toml"),
    }
    Ok(())
}
