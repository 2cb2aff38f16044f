//! What happens to a message that fails: the failure policy (retry
//! strategies and failure transports, per transport) and parking.
//!
//! The retry step of the pipeline asks the policy what to do with a message
//! whose handlers failed; the worker parks what fails outside it the same
//! way.

pub mod park;
pub mod policy;
pub mod strategy;

pub use park::{error_details, parked_again_delay, MAX_PARKED_AGAIN_DELAY};
pub use policy::FailurePolicy;
pub use strategy::{MultiplierRetryStrategy, RetryStrategy};
