//! What several transports need, written once: reading DSN options,
//! waiting between reconnects, storing headers as JSON, and fetching ahead
//! with lease freshness.

mod backoff;
pub(crate) mod dsn;
mod json_headers;
mod read_ahead;

pub use backoff::Backoff;
pub use dsn::DsnQuery;
pub use json_headers::{
    decode_json_headers, encode_json_headers, hex_literal, salvage as salvage_json_headers,
    STORED_HEADERS_HEADER,
};
pub use read_ahead::{ReadAhead, Taken};
