//! The layers of `envoi-core` hold: a top-level module only names modules
//! of its own layer's predecessors (`crate::<module>` paths, in code and in
//! doc links alike), never one listed after it in ARCHITECTURE.md.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// The layers, lowest first, as ARCHITECTURE.md's "Layers" section lists
/// them: one numbered line each, naming its modules in backquotes.
fn layers() -> Vec<Vec<String>> {
    let doc =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ARCHITECTURE.md"))
            .expect("ARCHITECTURE.md at the workspace root");
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Layers"))
        .expect("ARCHITECTURE.md has a `## Layers` section");
    section
        .lines()
        .filter(|l| {
            l.split_once(". ")
                .is_some_and(|(n, _)| n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty())
        })
        .map(|l| {
            let head = l.split(" — ").next().unwrap_or(l);
            head.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect()
        })
        .collect()
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text of a source file up to its first `#[cfg(test)]`: tests may
/// reach anywhere.
fn code(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap();
    match text.find("\n#[cfg(test)]") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// The first segments of the `crate::` paths in `text`, braces expanded
/// (`crate::{a::b, c}` names `a` and `c`).
fn named_modules(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut item, mut end) = (1, String::new(), group.len());
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 1 => {
                        out.push(first_segment(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    end = i;
                    break;
                }
                if depth >= 1 {
                    item.push(c);
                }
            }
            out.push(first_segment(&item));
            rest = &group[end..];
        } else {
            out.push(first_segment(rest));
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

fn first_segment(path: &str) -> String {
    path.trim()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The names `lib.rs` re-exports at the crate root, with the top-level
/// module each comes from: `crate::Messenger` names `messenger`.
fn root_reexports() -> BTreeMap<String, String> {
    let lib = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let mut out = BTreeMap::new();
    for item in lib.split(';') {
        let Some(path) = item.trim().strip_prefix("pub use ") else {
            continue;
        };
        let module = first_segment(path);
        let names = match path.find('{') {
            Some(open) => path[open + 1..].trim_end_matches('}').to_string(),
            None => path.rsplit("::").next().unwrap_or_default().to_string(),
        };
        for name in names.split(',') {
            let name = name
                .split(" as ")
                .last()
                .unwrap_or(name)
                .trim()
                .trim_start_matches("self");
            let name = first_segment(name.rsplit("::").next().unwrap_or(name));
            if !name.is_empty() {
                out.insert(name, module.clone());
            }
        }
    }
    out
}

#[test]
fn no_module_of_envoi_core_names_a_module_of_a_layer_above_its_own() {
    let reexports = root_reexports();
    assert_eq!(
        reexports.get("Messenger").map(String::as_str),
        Some("messenger")
    );
    let layers = layers();
    assert!(
        layers.len() > 3,
        "ARCHITECTURE.md lists the layers: {layers:?}"
    );
    let layer_of: BTreeMap<&str, usize> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, mods)| mods.iter().map(move |m| (m.as_str(), i)))
        .collect();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut upward = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" {
            continue;
        }
        let Some(&own) = layer_of.get(top.as_str()) else {
            panic!(
                "`{top}` (src/{}) is in no layer of ARCHITECTURE.md",
                rel.display()
            );
        };
        for named in named_modules(&code(file)) {
            let named = reexports.get(&named).cloned().unwrap_or(named);
            match layer_of.get(named.as_str()) {
                Some(&layer) if layer > own => upward.push(format!(
                    "src/{} ({top}, layer {}) names `crate::{named}` (layer {})",
                    rel.display(),
                    own + 1,
                    layer + 1
                )),
                _ => {}
            }
        }
    }
    upward.sort();
    upward.dedup();
    assert!(
        upward.is_empty(),
        "imports from a layer above:\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_path_reader_expands_braces_and_sees_doc_links() {
    assert_eq!(
        named_modules("use crate::{a::{b, c}, d};\n/// [x](crate::e::X)"),
        ["a", "d", "e"]
    );
}
