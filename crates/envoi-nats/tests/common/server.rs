//! A `nats-server` a test starts on a free port, with JetStream in a
//! directory of its own, and kills when it is dropped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the `nats-server` binary is: `/usr/sbin/nats-server`, or the
/// first one on `PATH`; or why there is none. What the tests that start
/// their own server need (`needs = common::server::binary` in their
/// `broker_tests!`).
pub fn binary() -> Result<PathBuf, String> {
    let on_path = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("nats-server"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    std::iter::once(PathBuf::from("/usr/sbin/nats-server"))
        .chain(on_path)
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            "no nats-server binary (neither /usr/sbin/nats-server nor one on PATH)".to_string()
        })
}

/// A running `nats-server`, killed on drop.
pub struct Server {
    child: Child,
    binary: PathBuf,
    args: Vec<String>,
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
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let child = spawn(binary, port, dir.path(), &log, &args);
        let mut server = Server {
            child,
            binary: binary.to_path_buf(),
            args,
            port,
            log,
            dir,
        };
        server.wait_until_ready(1);
        server
    }

    /// Stops the server with SIGTERM (it shuts down cleanly, saving
    /// JetStream's state), waiting up to 20 s for it to exit.
    pub fn stop(&mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM nats-server: {status}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while self
            .child
            .try_wait()
            .expect("nats-server's status")
            .is_none()
        {
            assert!(
                Instant::now() < deadline,
                "nats-server did not stop within 20 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the stopped server again on the same port with the same
    /// store; returns once it is ready.
    pub fn start_again(&mut self) {
        let started = self.readiness();
        self.child = spawn(
            &self.binary,
            self.port,
            self.dir.path(),
            &self.log,
            &self.args,
        );
        self.wait_until_ready(started + 1);
    }

    /// How many times the log says the server was ready.
    fn readiness(&self) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .matches("Server is ready")
            .count()
    }

    /// Waits until the log says the server was ready `times` times.
    fn wait_until_ready(&mut self, times: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            if log.matches("Server is ready").count() >= times {
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

/// Starts `binary` on `port`, its JetStream store and log in `dir`.
fn spawn(binary: &Path, port: u16, dir: &Path, log: &Path, args: &[String]) -> Child {
    Command::new(binary)
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(dir.join("jetstream"))
        .arg("-l")
        .arg(log)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nats-server")
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free port")
}
