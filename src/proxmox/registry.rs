//! One client per (URL, token, TLS settings), shared across reconciles so connection
//! pools, concurrency limits and counters are not rebuilt every time.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::client::{Fence, ProxmoxClient};
use super::config::{ClientConfig, endpoint_of};
use super::error::Result;
use super::gate::{DEFAULT_REQUESTS_IN_FLIGHT, GateStats, RequestGate};

/// A cache of clients keyed by their full configuration.
#[derive(Debug)]
pub struct ClientRegistry {
    clients: Mutex<HashMap<ClientConfig, ProxmoxClient>>,
    fence: Fence,
    requests_in_flight: usize,
    /// One per Proxmox API (`scheme://host:port`), whatever token or cluster reaches it.
    gates: Mutex<BTreeMap<String, Arc<RequestGate>>>,
}

impl Default for ClientRegistry {
    fn default() -> Self {
        Self::with_requests_in_flight(DEFAULT_REQUESTS_IN_FLIGHT)
    }
}

impl ClientRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty registry whose clients send at most `limit` requests to one Proxmox API at once.
    pub fn with_requests_in_flight(limit: usize) -> Self {
        Self {
            clients: Mutex::default(),
            fence: Fence::default(),
            requests_in_flight: limit.max(1),
            gates: Mutex::default(),
        }
    }

    fn gate(&self, url: &str) -> Arc<RequestGate> {
        let api = endpoint_of(url).unwrap_or_else(|| url.to_owned());
        let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        gates
            .entry(api)
            .or_insert_with(|| RequestGate::new(self.requests_in_flight))
            .clone()
    }

    /// What each Proxmox API's gate saw, by `scheme://host:port`, for `/metrics`.
    pub fn gate_stats(&self) -> BTreeMap<String, GateStats> {
        let gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        gates
            .iter()
            .map(|(api, gate)| (api.clone(), gate.stats()))
            .collect()
    }

    /// The shared client for this config, built on first use. A changed secret or TLS
    /// setting yields a new client; the old one is dropped when no caller holds it.
    pub fn get(&self, config: &ClientConfig) -> Result<ProxmoxClient> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(config) {
            return Ok(c.clone());
        }
        let client = ProxmoxClient::with_gate(config, self.fence.clone(), self.gate(&config.url))?;
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
