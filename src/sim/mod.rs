//! Stateful Proxmox VE simulator.
