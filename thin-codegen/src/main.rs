//! `thin-codegen generate` writes generated/; `thin-codegen check` fails when it is stale.
use anyhow::{bail, Context};

fn main() -> anyhow::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cmd = std::env::args().nth(1).unwrap_or_default();
    let files = thin_codegen::generate_all(&root).context("codegen failed")?;
    match cmd.as_str() {
        "generate" => {
            thin_codegen::write_files(&root, &files)?;
            println!("wrote {} files", files.len());
        }
        "check" => {
            let stale = thin_codegen::stale_files(&root, &files);
            if !stale.is_empty() {
                bail!("stale: {stale:?}\nrun: cargo run -p thin-codegen -- generate");
            }
        }
        _ => bail!("usage: thin-codegen generate|check"),
    }
    Ok(())
}
