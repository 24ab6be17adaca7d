//! capmox: Cluster API infrastructure provider for Proxmox VE.
pub mod proxmox;
pub mod sim;
