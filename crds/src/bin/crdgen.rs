//! Writes the CRD YAML next to this crate (`crds/*.yaml`) and into the Helm chart
//! (`charts/cosmosq/crds/`); `--stdout` prints them instead.

fn main() -> std::io::Result<()> {
    let to_stdout = std::env::args().any(|a| a == "--stdout");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (file, yaml) in cosmosq_crds::manifests() {
        if to_stdout {
            println!("---\n{yaml}");
            continue;
        }
        for dir in cosmosq_crds::MANIFEST_DIRS {
            std::fs::write(root.join(dir).join(file), &yaml)?;
            println!("wrote {}", root.join(dir).join(file).display());
        }
    }
    Ok(())
}
