//! capmox: Cluster API infrastructure provider for Proxmox VE.
pub mod testkit;
