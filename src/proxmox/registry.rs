//! One client per (URL, token, TLS settings), shared across reconciles so connection
//! pools, concurrency limits and counters are not rebuilt every time.

use std::collections::HashMap;
use std::sync::Mutex;

use super::client::{Fence, ProxmoxClient};
use super::config::ClientConfig;
use super::error::Result;

/// A cache of clients keyed by their full configuration.
#[derive(Debug, Default)]
pub struct ClientRegistry {
    clients: Mutex<HashMap<ClientConfig, ProxmoxClient>>,
    fence: Fence,
}

impl ClientRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The shared client for this config, built on first use. A changed secret or TLS
    /// setting yields a new client; the old one is dropped when no caller holds it.
    pub fn get(&self, config: &ClientConfig) -> Result<ProxmoxClient> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(config) {
            return Ok(c.clone());
        }
        let client = ProxmoxClient::with_fence(config, self.fence.clone())?;
        // Forget older clients for the same URL and token id (rotated secret or TLS change).
        clients.retain(|k, _| !(k.url == config.url && k.token.token_id == config.token.token_id));
        clients.insert(config.clone(), client.clone());
        Ok(client)
    }

    /// Stops every write of every client handed out, now and later (leadership was lost).
    pub fn fence(&self) {
        self.fence.raise();
    }

    /// Per-endpoint counters summed over every cached client, for `/metrics`.
    pub fn endpoint_stats(
        &self,
    ) -> std::collections::BTreeMap<String, super::client::EndpointStats> {
        let clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        let mut total: std::collections::BTreeMap<String, super::client::EndpointStats> =
            Default::default();
        for client in clients.values() {
            for (endpoint, stats) in client.metrics() {
                let entry = total.entry(endpoint).or_default();
                entry.calls += stats.calls;
                entry.errors += stats.errors;
                entry.total_latency += stats.total_latency;
                entry.max_latency = entry.max_latency.max(stats.max_latency);
            }
        }
        total
    }

    /// Number of cached clients.
    pub fn len(&self) -> usize {
        self.clients.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no client is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxmox::config::{ApiToken, Secret};

    #[test]
    fn reuses_clients_for_equal_configs() {
        let reg = ClientRegistry::new();
        let token = ApiToken::new("root@pam!capi", Secret::new("s1")).expect("token");
        let cfg = ClientConfig::new("http://127.0.0.1:9", token);
        let a = reg.get(&cfg).expect("client");
        let b = reg.get(&cfg).expect("client");
        assert!(
            std::ptr::eq(a.base_url(), b.base_url()),
            "same client expected"
        );
        assert_eq!(reg.len(), 1);
        let mut rotated = cfg.clone();
        rotated.token.secret = Secret::new("s2");
        let c = reg.get(&rotated).expect("client");
        assert!(!std::ptr::eq(a.base_url(), c.base_url()));
        assert_eq!(
            reg.len(),
            1,
            "old client for the rotated secret is forgotten"
        );
    }
}
