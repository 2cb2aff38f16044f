//! The README's Quickstart builds and runs as pasted: its `[dependencies]`
//! block becomes the `Cargo.toml` of a crate of its own (envoi taken from
//! this checkout instead of the registry), its code that crate's
//! `src/main.rs`; the crate is built and run, and must print the pipeline.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The fenced block of `lang` that starts first after `from` in `text`.
fn block<'a>(text: &'a str, lang: &str, from: usize) -> (&'a str, usize) {
    let fence = format!("```{lang}\n");
    let start = text[from..]
        .find(&fence)
        .map(|i| from + i + fence.len())
        .unwrap_or_else(|| panic!("the Quickstart has no ```{lang} block"));
    let end = start + text[start..].find("\n```").expect("the block is closed");
    (&text[start..=end], end)
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn the_readme_quickstart_builds_and_runs_as_a_crate_of_its_own() {
    let root = workspace();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let start = readme
        .find("\n## Quickstart\n")
        .expect("a Quickstart section");
    let end = readme[start + 1..]
        .find("\n## ")
        .map_or(readme.len(), |i| start + 1 + i);
    let section = &readme[start..end];
    let (dependencies, after) = block(section, "toml", 0);
    let (code, _) = block(section, "rust", after);
    assert!(
        !code.lines().any(|l| l.starts_with("# ") || l == "#"),
        "the Quickstart holds rustdoc's hidden lines, which do not compile when pasted"
    );
    assert!(
        code.contains("fn main()"),
        "the Quickstart has no main function"
    );

    let published = "envoi = \"0.1\"";
    assert!(
        dependencies.lines().any(|l| l == published),
        "the dependency block names envoi as `{published}`: {dependencies}"
    );
    let envoi = root.join("crates/envoi").canonicalize().unwrap();
    let dependencies = dependencies.replace(
        published,
        &format!("envoi = {{ path = {:?} }}", envoi.display().to_string()),
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("Cargo.toml"),
        format!(
            "[package]\nname = \"shop\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\n\
             [workspace]\n\n{dependencies}"
        ),
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("src")).unwrap();
    std::fs::write(dir.path().join("src/main.rs"), code).unwrap();
    // The same versions as this checkout, from the local registry cache.
    std::fs::copy(root.join("Cargo.lock"), dir.path().join("Cargo.lock")).unwrap();

    // A target directory of its own (the one running this test is locked),
    // kept between runs so that only the first one compiles everything.
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("readme-quickstart");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let built = Command::new(&cargo)
        .args(["build", "--quiet", "--offline"])
        .current_dir(dir.path())
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("RUSTFLAGS")
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "the Quickstart does not build as a crate:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(target.join("debug/shop")).output().unwrap();
    let stdout = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success(),
        "the Quickstart failed:\n{stdout}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert!(
        stdout.contains("CountMessages"),
        "the pipeline is printed: {stdout}"
    );
}
