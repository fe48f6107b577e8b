//! Writes the CRD YAML next to this crate (`crds/*.yaml`) and into the Helm chart
//! (`charts/cosmosq/crds/`), and the reference `docs/crds.md`; `--stdout` prints the YAML only.

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
    if !to_stdout {
        let path = root.join(cosmosq_crds::REFERENCE_PATH);
        std::fs::write(&path, cosmosq_crds::reference_markdown())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
