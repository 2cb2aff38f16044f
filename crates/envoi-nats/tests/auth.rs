//! Credentials and TLS from the DSN, against a `nats-server` each test
//! starts on a free port (with JetStream) and kills at its end: a user and
//! password, a token, an NKey seed file, a `.creds` file (a server in
//! operator mode, with JWTs the test makes), and TLS with a private
//! authority and a client certificate. Wrong credentials fail with
//! an error that names the DSN without its secret.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::server::Server;
use common::{get_n, unique_name};
use envoi_core::transport::{RawMessage, Receiver, Setup, Teardown, Transport};
use envoi_core::TransportError;
use envoi_nats::NatsTransport;

/// Connects with `dsn`, sends a message, receives and acknowledges it, and
/// deletes the stream.
async fn round_trip(dsn: &str) {
    let name = unique_name("auth");
    let t = NatsTransport::connect(&name, dsn)
        .await
        .unwrap_or_else(|e| panic!("connecting with {dsn}: {e}"));
    t.setup().await.expect("setup");
    let id = t
        .send(
            RawMessage {
                body: b"hello".to_vec(),
                ..RawMessage::default()
            },
            None,
        )
        .await
        .expect("send");
    let got = get_n(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(got.len(), 1, "the message sent never came back");
    assert_eq!(got[0].id.as_str(), id);
    assert_eq!(got[0].raw.body, b"hello");
    t.ack(&got[0].id).await.expect("ack");
    t.delete().await.expect("delete the stream");
    t.close().await.expect("close");
}

/// The error connecting with `dsn` (which must fail within 15 s), with
/// its text and debug form checked for `secret`.
async fn refused(dsn: &str, secret: &str) -> TransportError {
    let name = unique_name("auth");
    let connecting = NatsTransport::connect(&name, dsn);
    let error = tokio::time::timeout(Duration::from_secs(15), connecting)
        .await
        .unwrap_or_else(|_| panic!("connecting with wrong credentials never ended: {dsn}"))
        .err()
        .unwrap_or_else(|| panic!("connected with wrong credentials: {dsn}"));
    let shown = format!("{error} / {error:?}");
    assert!(!shown.contains(secret), "the secret shows: {shown}");
    error
}

/// `error` is `Unreachable` naming `dsn` and saying the server refused the
/// credentials.
fn assert_refused(error: &TransportError, dsn: &str) {
    match error {
        TransportError::Unreachable { dsn: shown, .. } => assert_eq!(shown, dsn),
        other => panic!("expected Unreachable, got {other:?}"),
    }
    let text = error.to_string();
    assert!(text.contains("authorization violation"), "{text}");
}

async fn a_user_and_password_in_the_dsn_authenticate_and_wrong_ones_are_refused(binary: PathBuf) {
    let password = "s3cr3t/p@ss:w rd";
    let server = Server::start(&binary, &["--user", "u", "--pass", password]);
    round_trip(&server.url_with("u:s3cr3t%2Fp%40ss%3Aw%20rd")).await;

    let wrong = server.url_with("u:not-the-s3cr3t");
    let error = refused(&wrong, "not-the-s3cr3t").await;
    assert_refused(&error, &server.url_with("u:***"));
    // No credentials at all.
    let error = refused(&server.url(), password).await;
    assert_refused(&error, &server.url());
}

async fn a_token_in_the_dsn_authenticates_and_a_wrong_one_is_refused(binary: PathBuf) {
    let server = Server::start(&binary, &["--auth", "t0k3n+s3cr3t"]);
    // As the user information, as NATS URLs give it, or as an option.
    round_trip(&server.url_with("t0k3n%2Bs3cr3t")).await;
    round_trip(&format!("{}?token=t0k3n%2Bs3cr3t", server.url())).await;

    let error = refused(&server.url_with("wr0ng-t0k3n"), "wr0ng-t0k3n").await;
    assert_refused(&error, &server.url_with("***"));
    let dsn = format!("{}?token=wr0ng-t0k3n", server.url());
    let error = refused(&dsn, "wr0ng-t0k3n").await;
    assert_refused(&error, &format!("{}?token=***", server.url()));
}

async fn an_nkey_seed_file_authenticates_and_another_key_is_refused(binary: PathBuf) {
    let user = nkeys::KeyPair::new_user();
    let dir = tempfile::tempdir().expect("a directory");
    let config = dir.path().join("nkey.conf");
    std::fs::write(
        &config,
        format!(
            "authorization {{ users = [ {{ nkey: \"{}\" }} ] }}\n",
            user.public_key()
        ),
    )
    .expect("write the server configuration");
    let server = Server::start(&binary, &["-c", config.to_str().expect("a UTF-8 path")]);

    // The seed alone, and in the decorated block `nsc` writes.
    let seed = user.seed().expect("a seed");
    let plain = dir.path().join("user.nk");
    std::fs::write(&plain, format!("{seed}\n")).expect("write the seed");
    let decorated = dir.path().join("user-decorated.nk");
    std::fs::write(
        &decorated,
        format!("-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"),
    )
    .expect("write the seed");
    for file in [&plain, &decorated] {
        round_trip(&format!(
            "{}?nkey_seed_file={}",
            server.url(),
            file.display()
        ))
        .await;
    }

    let stranger = dir.path().join("stranger.nk");
    let other_seed = nkeys::KeyPair::new_user().seed().expect("a seed");
    std::fs::write(&stranger, &other_seed).expect("write the seed");
    let dsn = format!("{}?nkey_seed_file={}", server.url(), stranger.display());
    let error = refused(&dsn, &other_seed).await;
    assert_refused(&error, &dsn);

    // A file that is not there, or holds no seed: named, its text never shown.
    let missing = format!("{}?nkey_seed_file=/nonexistent/user.nk", server.url());
    match refused(&missing, &seed).await {
        TransportError::InvalidDsn { reason, .. } => {
            assert!(reason.contains("/nonexistent/user.nk"), "{reason}")
        }
        other => panic!("expected InvalidDsn, got {other:?}"),
    }
    let not_a_seed = dir.path().join("not-a-seed.nk");
    std::fs::write(&not_a_seed, "pr1vate-n0t-a-seed\n").expect("write");
    let dsn = format!("{}?nkey_seed_file={}", server.url(), not_a_seed.display());
    match refused(&dsn, "pr1vate").await {
        TransportError::InvalidDsn { reason, .. } => {
            assert!(reason.contains("holds no NKey seed"), "{reason}")
        }
        other => panic!("expected InvalidDsn, got {other:?}"),
    }
}

async fn a_creds_file_that_cannot_be_used_is_named_in_the_error() {
    let dir = tempfile::tempdir().expect("a directory");
    let garbled = dir.path().join("garbled.creds");
    std::fs::write(&garbled, "pr1vate but no JWT in here\n").expect("write");
    // Files are read before connecting: no server needed.
    for (file, expected) in [
        (
            Path::new("/nonexistent/user.creds"),
            "cannot use `creds_file`",
        ),
        (garbled.as_path(), "cannot use `creds_file`"),
    ] {
        let dsn = format!("nats://127.0.0.1:1?creds_file={}", file.display());
        match refused(&dsn, "pr1vate").await {
            TransportError::InvalidDsn { reason, .. } => {
                assert!(reason.contains(expected), "{reason}");
                assert!(reason.contains(&file.display().to_string()), "{reason}");
            }
            other => panic!("expected InvalidDsn for {dsn}, got {other:?}"),
        }
    }
}

/// Makes, in `dir`, a certificate authority (`ca.pem`), a server
/// certificate for 127.0.0.1 (`server.pem`, `server.key`) and a client
/// certificate (`client.pem`, `client.key`) with `openssl`; `false` when
/// `openssl` cannot be run.
fn make_certificates(dir: &Path) -> bool {
    let openssl = |args: &[&str]| {
        Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .map(|out| {
                assert!(
                    out.status.success(),
                    "openssl {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            })
            .is_ok()
    };
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(key);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=envoi test CA",
    ]);
    if !openssl(&ca) {
        return false;
    }
    for (name, usage) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        ),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        std::fs::write(
            dir.join(format!("{name}.ext")),
            format!("basicConstraints=CA:FALSE\n{usage}"),
        )
        .expect("write the extensions");
        let (keyout, csr) = (format!("{name}.key"), format!("{name}.csr"));
        let subject = format!("/CN=envoi test {name}");
        let mut request = vec!["req"];
        request.extend(key);
        request.extend(["-keyout", &keyout, "-out", &csr, "-subj", &subject]);
        assert!(openssl(&request));
        let (pem, ext) = (format!("{name}.pem"), format!("{name}.ext"));
        assert!(openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ]));
    }
    true
}

async fn tls_with_a_private_authority_and_a_client_certificate(binary: PathBuf) {
    let test = "tls_with_a_private_authority_and_a_client_certificate";
    let certs = tempfile::tempdir().expect("a directory");
    let dir = certs.path();
    if !make_certificates(dir) {
        eprintln!("skipped {test}: openssl cannot be run to make certificates");
        return;
    }
    let file = |name: &str| dir.join(name).display().to_string();
    let server = Server::start(
        &binary,
        &[
            "--tlsverify",
            "--tlscert",
            &file("server.pem"),
            "--tlskey",
            &file("server.key"),
            "--tlscacert",
            &file("ca.pem"),
        ],
    );
    let trusted = format!(
        "{}?tls=true&tls_ca_file={}&tls_cert_file={}&tls_key_file={}",
        server.url(),
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    round_trip(&trusted).await;

    // Without the authority, the server's certificate is not trusted;
    // without a client certificate, the server refuses the client.
    for dsn in [
        format!(
            "{}?tls=true&tls_cert_file={}&tls_key_file={}",
            server.url(),
            file("client.pem"),
            file("client.key")
        ),
        format!("{}?tls=true&tls_ca_file={}", server.url(), file("ca.pem")),
    ] {
        let name = unique_name("tls");
        let connecting = NatsTransport::connect(&name, &dsn);
        match tokio::time::timeout(Duration::from_secs(15), connecting).await {
            Ok(Err(TransportError::Unreachable { dsn: shown, .. })) => assert_eq!(shown, dsn),
            Ok(Err(other)) => panic!("expected Unreachable for {dsn}, got {other:?}"),
            Ok(Ok(_)) => panic!("connected without the right certificates: {dsn}"),
            Err(_) => panic!("connecting never ended: {dsn}"),
        }
    }

    // A certificate file that is not there is named before connecting.
    let dsn = format!("{}?tls=true&tls_ca_file=/nonexistent/ca.pem", server.url());
    match NatsTransport::connect(&unique_name("tls"), &dsn).await {
        Err(TransportError::InvalidDsn { reason, .. }) => {
            assert!(
                reason.contains("`tls_ca_file` /nonexistent/ca.pem"),
                "{reason}"
            )
        }
        other => panic!("expected InvalidDsn, got {:?}", other.err()),
    }
    drop(server);
}

/// Base64 without padding, URL-safe alphabet: how JWTs encode.
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

/// A NATS JWT for `subject`, signed by `issuer`, with `nats` as its NATS
/// claims.
fn jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    let header = base64url(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": unique_name("jti").replace('-', ""),
        "iat": 1_700_000_000u64,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let body = base64url(claims.to_string().as_bytes());
    let signed = format!("{header}.{body}");
    let signature = issuer.sign(signed.as_bytes()).expect("sign");
    format!("{signed}.{}", base64url(&signature))
}

async fn a_creds_file_authenticates_against_a_server_in_operator_mode(binary: PathBuf) {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let system = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let operator_jwt = jwt(
        &operator,
        &operator.public_key(),
        "envoi-operator",
        serde_json::json!({"type": "operator", "version": 2}),
    );
    let account_claims = |jetstream: bool| {
        let storage = if jetstream { -1 } else { 0 };
        serde_json::json!({
            "limits": {
                "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                "wildcards": true, "conn": -1, "leaf": -1,
                "mem_storage": storage, "disk_storage": storage, "streams": storage,
                "consumer": storage,
            },
            "default_permissions": {"pub": {}, "sub": {}},
            "type": "account",
            "version": 2,
        })
    };
    let account_jwt = jwt(
        &operator,
        &account.public_key(),
        "envoi",
        account_claims(true),
    );
    let system_jwt = jwt(
        &operator,
        &system.public_key(),
        "SYS",
        account_claims(false),
    );
    let user_claims = serde_json::json!({
        "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
        "type": "user", "version": 2,
    });
    let user_jwt = jwt(&account, &user.public_key(), "envoi-user", user_claims);

    let dir = tempfile::tempdir().expect("a directory");
    let config = dir.path().join("operator.conf");
    std::fs::write(
        &config,
        format!(
            "operator: {operator_jwt}\nsystem_account: {system}\nresolver: MEMORY\n\
             resolver_preload: {{\n  {account}: {account_jwt}\n  {system}: {system_jwt}\n}}\n",
            system = system.public_key(),
            account = account.public_key(),
        ),
    )
    .expect("write the server configuration");
    let server = Server::start(&binary, &["-c", config.to_str().expect("a UTF-8 path")]);

    let seed = user.seed().expect("a seed");
    let creds = dir.path().join("user.creds");
    std::fs::write(
        &creds,
        format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        ),
    )
    .expect("write the creds file");
    round_trip(&format!("{}?creds_file={}", server.url(), creds.display())).await;

    // Without credentials the server refuses the client.
    let error = refused(&server.url(), &seed).await;
    assert_refused(&error, &server.url());
}

envoi_transport_tests::broker_tests! {
    needs = common::server::binary, tests = [
        a_user_and_password_in_the_dsn_authenticate_and_wrong_ones_are_refused,
        a_token_in_the_dsn_authenticates_and_a_wrong_one_is_refused,
        an_nkey_seed_file_authenticates_and_another_key_is_refused,
        tls_with_a_private_authority_and_a_client_certificate,
        a_creds_file_authenticates_against_a_server_in_operator_mode,
    ];
    tests = [
        a_creds_file_that_cannot_be_used_is_named_in_the_error: current_thread,
    ];
}
