//! Writes the CRD YAML next to this crate (`crds/*.yaml`); `--stdout` prints them instead.

fn main() -> std::io::Result<()> {
    let to_stdout = std::env::args().any(|a| a == "--stdout");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (file, yaml) in cosmosq_crds::manifests() {
        if to_stdout {
            println!("---\n{yaml}");
        } else {
            std::fs::write(dir.join(file), yaml)?;
            println!("wrote crds/{file}");
        }
    }
    Ok(())
}
