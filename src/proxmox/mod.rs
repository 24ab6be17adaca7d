//! Typed Proxmox VE REST client: API-token auth, verified TLS (CA bundle or pinned
//! fingerprint), classified errors, tolerant decoding, task waiting, retries and counters.

pub mod api;
pub mod client;
pub mod config;
pub mod de;
pub mod error;
pub mod registry;
pub mod tasks;
pub mod tls;
pub mod types;
pub mod upid;

pub use api::{CLIENT_ENDPOINTS, CloudInitStatus, ResourceFilter};
pub use client::{EndpointStats, ProxmoxClient, error_from_parts};
pub use config::{ApiToken, ClientConfig, RetryPolicy, Secret, TlsOptions};
pub use error::{ProxmoxError, Result};
pub use registry::ClientRegistry;
pub use tasks::WaitOptions;
pub use tls::Fingerprint;
pub use types::*;
pub use upid::Upid;
