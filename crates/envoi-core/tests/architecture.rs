//! ARCHITECTURE.md's code map names every file of every crate's `src/`
//! (the benchmark harness aside), under its crate's heading, and names no
//! file that is gone.

use std::fs;
use std::path::{Path, PathBuf};

fn files(dir: &Path, root: &Path, out: &mut Vec<String>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path: PathBuf = entry.unwrap().path();
        if path.is_dir() {
            files(&path, root, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(
                path.strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
}

#[test]
fn the_code_map_names_every_source_file_and_no_other() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = fs::read_to_string(workspace.join("ARCHITECTURE.md")).unwrap();
    let mut missing = Vec::new();
    let mut stale = Vec::new();
    for crate_dir in fs::read_dir(workspace.join("crates")).unwrap() {
        let crate_dir = crate_dir.unwrap().path();
        let name = crate_dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let src = crate_dir.join("src");
        if name == "envoi-bench" || !src.is_dir() {
            continue;
        }
        let heading = format!("### `crates/{name}/src`");
        let section = doc
            .split_once(&heading)
            .map(|(_, rest)| rest.split("\n### ").next().unwrap_or_default())
            .unwrap_or_else(|| panic!("ARCHITECTURE.md has no `{heading}` section"));
        let mut found = Vec::new();
        files(&src, &src, &mut found);
        for file in &found {
            if !section.contains(&format!("* `{file}` —")) {
                missing.push(format!("crates/{name}/src/{file}"));
            }
        }
        for line in section.lines() {
            if let Some(rest) = line.strip_prefix("* `") {
                let named = rest.split('`').next().unwrap_or_default();
                if !found.iter().any(|f| f == named) {
                    stale.push(format!("crates/{name}/src/{named}"));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in ARCHITECTURE.md's code map: {missing:#?}"
    );
    assert!(stale.is_empty(), "in the code map but gone: {stale:#?}");
}
