#![allow(dead_code)]
//! Shared helpers for integration tests.
pub mod fixture_server;
