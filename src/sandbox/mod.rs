//! Pieces that let capmox run end to end on one machine without a real management cluster:
//! [`standin`] plays CAPI core and KCP for the infrastructure-provider contract.

pub mod standin;
