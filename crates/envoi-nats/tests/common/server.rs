//! A `nats-server` a test starts on a free port, with JetStream in a
//! directory of its own, and kills when it is dropped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the `nats-server` binary is: `/usr/sbin/nats-server`, or the
/// first one on `PATH`. `None` after printing why `test` is skipped.
pub fn binary(test: &str) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("nats-server"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let found = std::iter::once(PathBuf::from("/usr/sbin/nats-server"))
        .chain(on_path)
        .find(|candidate| candidate.is_file());
    if found.is_none() {
        eprintln!(
            "skipped {test}: no nats-server binary (neither /usr/sbin/nats-server nor one on PATH)"
        );
    }
    found
}

/// A running `nats-server`, killed on drop.
pub struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
    /// The JetStream store and the log, removed on drop.
    dir: tempfile::TempDir,
}

impl Server {
    /// Starts `binary` on a free port of 127.0.0.1 with JetStream (its
    /// store in a fresh directory) and `args`; returns once its log says it
    /// is ready. Panics, with the log, when it is not ready within 20 s.
    pub fn start(binary: &Path, args: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("a directory for the server");
        let log = dir.path().join("nats-server.log");
        let port = free_port();
        let child = Command::new(binary)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.path().join("jetstream"))
            .arg("-l")
            .arg(&log)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        let mut server = Server {
            child,
            port,
            log,
            dir,
        };
        server.wait_until_ready();
        server
    }

    /// Waits for "Server is ready" in the log.
    fn wait_until_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            if log.contains("Server is ready") {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("nats-server exited ({status}) before it was ready; its log:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "nats-server on port {} was not ready within 20 s; its log:\n{log}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// `nats://<user_info>@127.0.0.1:<port>`.
    pub fn url_with(&self, user_info: &str) -> String {
        format!("nats://{user_info}@127.0.0.1:{}", self.port)
    }

    /// A directory for the test's files, removed with the server.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free port")
}
