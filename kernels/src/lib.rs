//! Copy, gather, scatter and fill kernels: CUDA C compiled at run time (NVRTC) with CPU twins of
//! the same semantics for the host backend. This crate starts with the fill-pattern twin that the
//! tests and the demo use to check contents end to end; the tiers issue adds gather/scatter.
#![deny(unsafe_code)]

pub mod pattern;
