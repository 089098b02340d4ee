//! strata: GPU memory virtualization on the CUDA virtual-memory API.
#![doc = include_str!("../README.md")]

pub use strata_allocator as allocator;
pub use strata_replay as replay;
pub use strata_runtime as runtime;
pub use strata_sim as sim;
pub use strata_tiers as tiers;
pub use strata_vmm as vmm;
pub use strata_vmm::{Backend, Error, Result};
