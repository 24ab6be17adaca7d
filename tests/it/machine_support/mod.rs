//! The ProxmoxMachine crash and event tests' scenario (an Env plus a request tap) and the tap.

#![allow(dead_code)]

pub mod lag;
pub mod scenario;
pub mod tap;
