//! Typed Proxmox VE REST client: API-token auth, verified TLS (CA bundle or pinned
//! fingerprint), classified errors, tolerant decoding, task waiting, retries and counters.
//!
//! ```no_run
//! use std::time::Duration;
//! use capmox::proxmox::*;
//!
//! # async fn demo(registry: &ClientRegistry) -> Result<()> {
//! let token = ApiToken::new("capmox@pve!capi", Secret::new("3f2c9c8e-..."))?;
//! let mut config = ClientConfig::new("https://pve1.example.com:8006", token);
//! config.tls.fingerprints = vec!["AB:CD:...".into()]; // or config.tls.ca_pem
//! let client = registry.get(&config)?; // shared per (URL, token, TLS)
//! let vmid = client.next_id(None).await?;
//! let upid = client
//!     .clone_vm("pve1", 9000, &CloneParams { newid: vmid, full: Some(true), ..Default::default() })
//!     .await?;
//! client.wait_task(&upid, &WaitOptions::with_deadline(Duration::from_secs(600))).await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod api;
pub mod client;
pub mod config;
pub mod de;
pub mod error;
pub mod gate;
pub(crate) mod path;
pub mod registry;
pub mod tasks;
pub mod tls;
pub mod types;
pub mod upid;

pub use api::{CLIENT_ENDPOINTS, CLIENT_ENDPOINTS_PVE9, CloudInitStatus, ResourceFilter};
pub use client::{EndpointStats, Fence, MAX_RESPONSE_BODY, ProxmoxClient, error_from_parts};
pub use config::{ApiToken, ClientConfig, RetryPolicy, Secret, TlsOptions, endpoint_of};
pub use error::{ProxmoxError, Result};
pub use gate::{DEFAULT_REQUESTS_IN_FLIGHT, GateStats, RequestGate};
pub use registry::ClientRegistry;
pub use tasks::WaitOptions;
pub use tls::Fingerprint;
pub use types::*;
pub use upid::Upid;
