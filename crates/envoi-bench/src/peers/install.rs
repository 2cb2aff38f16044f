//! Installing a peer from its package registry, once, into a cache under
//! the target directory (`<target>/peers/<peer>`).
//!
//! A peer's scripts and pinned manifest live in `crates/envoi-bench/peers/
//! <peer>/`. Every run copies them into the cache, then installs what the
//! manifest pins when the cache does not hold that exact manifest yet
//! (`.installed` keeps a copy of the manifest it was installed from):
//! `npm ci` for a `package-lock.json`, `pip install --target site -r
//! requirements.txt` for Python. Debian packages (Symfony's) are installed
//! with `apt-get install -y` only when one is missing. Every command is
//! printed on stderr before it runs.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where a peer's sources live in this crate.
fn source_dir(peer: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("peers")
        .join(peer)
}

/// The target directory this binary was built into (`CARGO_TARGET_DIR`, or
/// the parent of its profile directory).
pub(super) fn target_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return Ok(PathBuf::from(dir));
    }
    std::env::current_exe()
        .map_err(|e| format!("cannot locate the target directory: {e}"))?
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .ok_or_else(|| "cannot locate the target directory".to_owned())
}

/// The cache directory of `peer`.
pub(super) fn cache_dir(peer: &str) -> Result<PathBuf, String> {
    Ok(target_dir()?.join("peers").join(peer))
}

/// Runs `cmd`, printing it first; `Err` names it and how it ended.
pub(super) fn run_printed(mut cmd: Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    eprintln!("  running {shown}");
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run {shown}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} exited with {status}"))
    }
}

/// Whether `program` runs here (`program --version` succeeds).
pub(super) fn available(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Copies the regular files of `peer`'s source directory into its cache
/// and returns the cache.
fn copy_sources(peer: &str) -> Result<PathBuf, String> {
    let from = source_dir(peer);
    let to = cache_dir(peer)?;
    std::fs::create_dir_all(&to).map_err(|e| format!("cannot create {}: {e}", to.display()))?;
    let entries =
        std::fs::read_dir(&from).map_err(|e| format!("cannot read {}: {e}", from.display()))?;
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_file()) {
            let dest = to.join(entry.file_name());
            std::fs::copy(entry.path(), &dest)
                .map_err(|e| format!("cannot copy {} to the cache: {e}", entry.path().display()))?;
        }
    }
    Ok(to)
}

/// Whether `dir` was installed from exactly the manifest `dir/<manifest>`.
fn installed_from(dir: &Path, manifest: &str) -> bool {
    let stamp = std::fs::read(dir.join(".installed"));
    let current = std::fs::read(dir.join(manifest));
    matches!((stamp, current), (Ok(a), Ok(b)) if a == b)
}

fn stamp(dir: &Path, manifest: &str) -> Result<(), String> {
    std::fs::copy(dir.join(manifest), dir.join(".installed"))
        .map(|_| ())
        .map_err(|e| format!("cannot record the installed manifest: {e}"))
}

/// Copies an npm peer into its cache and runs `npm ci` there unless its
/// lock file is installed already. Returns the cache.
pub(super) fn npm(peer: &str) -> Result<PathBuf, String> {
    for program in ["node", "npm"] {
        if !available(program) {
            return Err(format!("`{program}` is not installed"));
        }
    }
    let dir = copy_sources(peer)?;
    if !installed_from(&dir, "package-lock.json") || !dir.join("node_modules").is_dir() {
        let mut cmd = Command::new("npm");
        cmd.args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&dir);
        run_printed(cmd)?;
        stamp(&dir, "package-lock.json")?;
    }
    Ok(dir)
}

/// Copies a Python peer into its cache and installs its `requirements.txt`
/// into `site/` there unless that is installed already. Returns the cache.
pub(super) fn pip(peer: &str) -> Result<PathBuf, String> {
    if !available("python3") {
        return Err("`python3` is not installed".into());
    }
    let dir = copy_sources(peer)?;
    if !installed_from(&dir, "requirements.txt") || !dir.join("site").is_dir() {
        let site = dir.join("site");
        let _ = std::fs::remove_dir_all(&site);
        let mut cmd = Command::new("python3");
        cmd.args(["-m", "pip", "install", "--quiet", "--target"])
            .arg(&site)
            .args(["-r", "requirements.txt"])
            .current_dir(&dir);
        run_printed(cmd)?;
        stamp(&dir, "requirements.txt")?;
    }
    Ok(dir)
}

/// Whether the Debian package `name` is installed.
fn deb_installed(name: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", name])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

/// Copies a peer into its cache after installing those of `packages` that
/// are missing with `apt-get install -y`. Returns the cache.
pub(super) fn apt(peer: &str, packages: &[&str]) -> Result<PathBuf, String> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !deb_installed(p))
        .collect();
    if !missing.is_empty() {
        if !available("apt-get") {
            return Err(format!(
                "the Debian packages {} are missing and there is no apt-get",
                missing.join(" ")
            ));
        }
        let mut cmd = Command::new("apt-get");
        cmd.args(["install", "-y", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive");
        run_printed(cmd)?;
    }
    copy_sources(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_peer_ships_a_pinned_manifest() {
        for (peer, manifest) in [
            ("graphile", "package-lock.json"),
            ("bullmq", "package-lock.json"),
            ("dramatiq", "requirements.txt"),
        ] {
            let path = source_dir(peer).join(manifest);
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(!text.is_empty(), "{} is empty", path.display());
        }
        let requirements =
            std::fs::read_to_string(source_dir("dramatiq").join("requirements.txt")).unwrap();
        for line in requirements
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        {
            assert!(line.contains("=="), "`{line}` is not pinned to one version");
        }
    }

    #[test]
    fn a_manifest_counts_as_installed_only_when_the_stamp_matches_it() {
        let dir =
            std::env::temp_dir().join(format!("envoi-bench-install-{}", super::super::unique()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("m.txt"), "a==1\n").unwrap();
        assert!(!installed_from(&dir, "m.txt"));
        stamp(&dir, "m.txt").unwrap();
        assert!(installed_from(&dir, "m.txt"));
        std::fs::write(dir.join("m.txt"), "a==2\n").unwrap();
        assert!(!installed_from(&dir, "m.txt"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_program_is_not_available() {
        assert!(!available("envoi-bench-no-such-program"));
    }
}
