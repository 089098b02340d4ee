//! Copy, gather, scatter and fill kernels: CUDA C compiled at run time (NVRTC) with CPU twins of
//! the same semantics for the host backend, and the CPU twin of the device GEMM.
//!
//! This crate is a leaf (no dependencies): `vmm`'s host backend runs the twins when it executes a
//! kernel launch, and the CUDA backend takes the sources from here.
#![deny(unsafe_code)]

pub mod blockcopy;
pub mod gemm;
pub mod pattern;
