//! What several transports need, written once: reading DSN options,
//! reaching a backend within a bounded time, waiting between reconnects, storing headers as JSON, and fetching ahead
//! with lease freshness.

mod backoff;
mod connect;
pub(crate) mod dsn;
mod json_headers;
mod read_ahead;

pub use backoff::Backoff;
pub use connect::{connect_within, unreachable, DEFAULT_CONNECT_TIMEOUT};
pub use dsn::DsnQuery;
pub use json_headers::{
    decode_json_headers, encode_json_headers, hex_literal, salvage as salvage_json_headers,
    STORED_HEADERS_HEADER,
};
pub use read_ahead::{ReadAhead, Taken};
