//! strata: GPU memory virtualization on the CUDA virtual-memory API.
#![doc = include_str!("../README.md")]

pub mod demo;

pub use strata_allocator as allocator;
pub use strata_vmm as vmm;
pub use strata_vmm::{Backend, Error, Result};
