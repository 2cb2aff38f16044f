//! Who the client is and how it talks to the server: credentials and TLS
//! from the DSN, the DSN with its secrets masked, and the client's connect
//! options.

use std::path::Path;

use async_nats::ConnectOptions;
use envoi_core::transport::mask_dsn;
use percent_encoding::percent_decode_str;
use url::Url;

use crate::NatsConfig;

/// The credentials in a DSN's user information: `user:password` (a user
/// and a password), or a lone `token`, as NATS URLs give one. Both
/// percent-decoded.
#[derive(Default)]
pub(crate) struct UserInfo {
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) token: Option<String>,
}

/// Reads the user information of `url` (parsed from `dsn`).
pub(crate) fn user_info(url: &Url, dsn: &str) -> Result<UserInfo, String> {
    let decode = |part: &str, what: &str| {
        percent_decode_str(part)
            .decode_utf8()
            .map(|text| text.into_owned())
            .map_err(|_| format!("the {what} is not valid percent-encoded UTF-8"))
    };
    let user = url.username();
    match url.password() {
        Some(password) => Ok(UserInfo {
            user: Some(decode(user, "user")?),
            password: Some(decode(password, "password")?),
            token: None,
        }),
        None if user.is_empty() => Ok(UserInfo::default()),
        // `user:@host`: the URL parser drops an empty password, which NATS
        // reads as a user without a password, not as a token.
        None if raw_user_info(dsn).is_some_and(|info| info.contains(':')) => Ok(UserInfo {
            user: Some(decode(user, "user")?),
            password: Some(String::new()),
            token: None,
        }),
        None => Ok(UserInfo {
            token: Some(decode(user, "token")?),
            ..UserInfo::default()
        }),
    }
}

/// The user information of `dsn` as written: what comes between `://` and
/// the last `@` before the query.
fn raw_user_info(dsn: &str) -> Option<&str> {
    let rest = &dsn[dsn.find("://")? + 3..];
    let before_query = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    before_query.rfind('@').map(|at| &rest[..at])
}

/// `dsn` with every secret masked, for errors and logs: the password of
/// `user:password@` and the `password` and `token` options (as every
/// transport masks them, with core's `mask_dsn`), and a token given as the
/// user information (`nats://***@host`), which is NATS's own.
///
/// ```text
/// nats://u:secret@h?token=t0k3n  →  nats://u:***@h?token=***
/// nats://t0k3n@h                 →  nats://***@h
/// ```
pub(crate) fn mask(dsn: &str) -> String {
    mask_lone_user_info(&mask_dsn(dsn))
}

/// Masks user information without a `:` (a token).
fn mask_lone_user_info(dsn: &str) -> String {
    let Some(info) = raw_user_info(dsn) else {
        return dsn.to_string();
    };
    if info.is_empty() || info.contains(':') {
        return dsn.to_string();
    }
    let start = dsn.find("://").map_or(0, |i| i + 3);
    format!("{}***{}", &dsn[..start], &dsn[start + info.len()..])
}

/// The server URL of `config` with its credentials, masked: how errors
/// name a server configured in code.
pub(crate) fn masked_server(config: &NatsConfig) -> String {
    let userinfo = match (&config.user, &config.token) {
        (Some(user), _) => format!("{user}:***@"),
        (None, Some(_)) => "***@".to_string(),
        (None, None) => String::new(),
    };
    match config.server.split_once("://") {
        Some((scheme, rest)) if !userinfo.is_empty() => format!("{scheme}://{userinfo}{rest}"),
        _ => config.server.clone(),
    }
}

/// The NKey seed in the text of a seed file: the first line that is one
/// (`S` and base32 letters), alone or in the decorated block `nsc` and
/// `nk` write.
fn nkey_seed(text: &str) -> Option<&str> {
    text.lines().map(str::trim).find(|line| {
        line.len() >= 50
            && line.starts_with('S')
            && line
                .bytes()
                .all(|b| b.is_ascii_uppercase() || (b'2'..=b'7').contains(&b))
    })
}

/// Reads file `path` named by option `option`; the error says which and
/// why, never what the file holds.
fn read(option: &str, path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read `{option}` {}: {e}", path.display()))
}

/// Checks that the file named by `option` can be read.
fn readable(option: &str, path: &Path) -> Result<(), String> {
    std::fs::File::open(path)
        .map(drop)
        .map_err(|e| format!("cannot read `{option}` {}: {e}", path.display()))
}

/// The client's authentication and TLS options for `config`, on top of
/// `options`. Reads the files it names (the NKey seed, the `.creds` file);
/// checks that the TLS files can be read (the client reads them when it
/// connects). The error says which file and why.
pub(crate) async fn with_credentials(
    config: &NatsConfig,
    mut options: ConnectOptions,
) -> Result<ConnectOptions, String> {
    if let (Some(user), Some(password)) = (&config.user, &config.password) {
        options = options.user_and_password(user.clone(), password.clone());
    }
    if let Some(token) = &config.token {
        options = options.token(token.clone());
    }
    if let Some(path) = &config.nkey_seed_file {
        let text = read("nkey_seed_file", path)?;
        let seed = nkey_seed(&text).ok_or_else(|| {
            format!(
                "`nkey_seed_file` {} holds no NKey seed (a line of `S` and base32 letters)",
                path.display()
            )
        })?;
        options = options.nkey(seed.to_string());
    }
    if let Some(path) = &config.creds_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| format!("cannot use `creds_file` {}: {e}", path.display()))?;
    }
    // A server may ask for TLS even when the DSN does not.
    use_ring_provider();
    options = options.require_tls(config.tls);
    if let Some(path) = &config.tls_ca_file {
        readable("tls_ca_file", path)?;
        options = options.add_root_certificates(path.clone());
    }
    if let (Some(cert), Some(key)) = (&config.tls_cert_file, &config.tls_key_file) {
        readable("tls_cert_file", cert)?;
        readable("tls_key_file", key)?;
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    Ok(options)
}

/// async-nats builds its TLS configuration with rustls's process-wide
/// crypto provider. With a second provider compiled into the program (the
/// AMQP transport's client brings aws-lc-rs), rustls cannot pick one by
/// itself and panics on the first TLS connection; this installs ring,
/// async-nats's own, unless the program installed a provider already.
fn use_ring_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: one is installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(dsn: &str) -> UserInfo {
        user_info(&Url::parse(dsn).unwrap(), dsn).unwrap()
    }

    #[test]
    fn user_information_is_a_user_and_password_or_a_token_percent_decoded() {
        let i = info("nats://us%40er:p%3As%2Fs%20w@h:4222");
        assert_eq!(i.user.as_deref(), Some("us@er"));
        assert_eq!(i.password.as_deref(), Some("p:s/s w"));
        assert_eq!(i.token, None);

        let i = info("nats://t0k%2Fen@h:4222");
        assert_eq!((i.user, i.password), (None, None));
        assert_eq!(i.token.as_deref(), Some("t0k/en"));

        let i = info("nats://u:@h:4222");
        assert_eq!(i.user.as_deref(), Some("u"));
        assert_eq!(i.password.as_deref(), Some(""));
        assert_eq!(i.token, None);

        let i = info("nats://h:4222");
        assert_eq!((i.user, i.password, i.token), (None, None, None));

        let dsn = "nats://u:%FF@h";
        let why = user_info(&Url::parse(dsn).unwrap(), dsn).err().unwrap();
        assert!(why.contains("password"), "{why}");
    }

    #[test]
    fn masking_hides_passwords_and_tokens_and_nothing_else() {
        assert_eq!(mask("nats://u:secret@h:4222"), "nats://u:***@h:4222");
        assert_eq!(
            mask("nats://t0k3n@h:4222?lease=1s"),
            "nats://***@h:4222?lease=1s"
        );
        assert_eq!(
            mask("nats://h:4222?lease=1s&token=t0k3n&TOKEN=x#f"),
            "nats://h:4222?lease=1s&token=***&TOKEN=***#f"
        );
        assert_eq!(
            mask("nats://h:4222?password=hunter2"),
            "nats://h:4222?password=***"
        );
        assert_eq!(mask("nats://h:4222?stream=s"), "nats://h:4222?stream=s");
        assert_eq!(mask("not a dsn"), "not a dsn");
    }

    #[test]
    fn odd_dsns_are_masked_and_parsed_without_panicking() {
        for dsn in [
            "",
            "://",
            "nats://@",
            "nats://:@h",
            "nats://a@b@c?x=@#@",
            "é://é@é?token=é#é",
            "nats://u:p@h?token",
            "?token=x",
            "nats://h?&&=&token=&",
            "nats://%@h",
            "nats://u:%zz@h",
            "nats://h:4222?token=%FF",
        ] {
            let masked = mask(dsn);
            if let Err(e) = crate::NatsConfig::from_dsn(dsn) {
                let shown = e.to_string();
                assert!(!shown.contains("token=x"), "{dsn}: {shown}");
            }
            assert!(!masked.contains("token=x"), "{dsn}: {masked}");
        }
    }

    #[test]
    fn a_seed_is_found_alone_or_in_its_decorated_block() {
        let seed = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU";
        assert_eq!(nkey_seed(&format!("{seed}\n")), Some(seed));
        let decorated =
            format!("-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n");
        assert_eq!(nkey_seed(&decorated), Some(seed));
        assert_eq!(nkey_seed("UAAAA\nnot a seed\n"), None);
        assert_eq!(nkey_seed(""), None);
    }
}
