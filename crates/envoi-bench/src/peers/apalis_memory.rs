//! apalis 1.0's in-memory backend (crates.io): `memory_vs_apalis`.
//!
//! The side is the `apalis-memory` binary of the standalone project
//! `crates/envoi-bench/peers/apalis-memory` (its own lock file, so apalis
//! stays out of envoi's workspace), built with `cargo build --release` into
//! this binary's target directory on first use. It runs one apalis worker
//! of concurrency 64 (envoi's side runs 64 handlers too) over
//! `MemoryStorage` and pushes from 64 concurrent producers while it runs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::install;

/// Handlers in flight, as on envoi's side.
const CONCURRENCY: usize = 64;

/// Builds `apalis-memory` once per run.
pub(super) fn prepare() -> Result<(), String> {
    binary().map(|_| ())
}

fn binary() -> Result<PathBuf, String> {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BINARY.get_or_init(build).clone()
}

fn build() -> Result<PathBuf, String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/apalis-memory/Cargo.toml");
    let target = install::target_dir()?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .env("CARGO_TARGET_DIR", &target);
    install::run_printed(cmd)?;
    let binary = target.join("release").join("apalis-memory");
    if binary.is_file() {
        Ok(binary)
    } else {
        Err(format!(
            "apalis-memory built but {} is missing",
            binary.display()
        ))
    }
}

/// One round of `memory_vs_apalis`.
pub(super) fn command(_url: &str, n: u64) -> Result<Command, String> {
    let mut cmd = Command::new(binary()?);
    cmd.args([
        "--n",
        &n.to_string(),
        "--concurrency",
        &CONCURRENCY.to_string(),
    ]);
    Ok(cmd)
}
