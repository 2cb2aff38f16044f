//! The README's "Testing your handlers" examples run here as written: each
//! is a file of `readme/`, compiled into a module below, and the README must
//! show them unchanged.

use std::path::Path;

#[path = "readme/deferring.rs"]
mod deferring;
#[path = "readme/parking.rs"]
mod parking;

/// The ```` ```rust ```` blocks of the README's section `heading`, in order.
fn rust_blocks(readme: &str, heading: &str) -> Vec<String> {
    let start = readme
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("the README has a section `{heading}`"));
    let end = readme[start + 1..]
        .find("\n## ")
        .map_or(readme.len(), |i| start + 1 + i);
    let mut blocks = Vec::new();
    let mut rest = &readme[start..end];
    while let Some(open) = rest.find("\n```rust\n") {
        let body = &rest[open + "\n```rust\n".len()..];
        let close = body.find("\n```\n").expect("the block is closed");
        blocks.push(format!("{}\n", &body[..close]));
        rest = &body[close..];
    }
    blocks
}

#[test]
fn the_readme_shows_the_testing_examples_that_run_here() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let blocks = rust_blocks(&readme, "Testing your handlers");
    assert_eq!(
        blocks,
        [
            include_str!("readme/deferring.rs"),
            include_str!("readme/parking.rs")
        ],
        "the README's examples differ from crates/envoi/tests/readme/"
    );
}
