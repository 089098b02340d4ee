//! KVPR's device runtime on a real GPU (cuBLAS). GPU-only: `#[ignore]`d so it shows as skipped
//! where there is no GPU; on a GPU machine run
//! `cargo test -p strata-tiers --test kvpr_gpu -- --include-ignored`.
//!
//! Integer-valued data keep every FP32 partial sum exact, so whatever order cuBLAS sums in, the
//! merged KV must equal the twin's bit for bit; fractional data then compare with a tolerance
//! (cuBLAS's summation order and fused multiply-adds differ from the twin's).

mod common;

use std::sync::Arc;

use common::kvpr::Data;
use strata_tiers::kvpr::transfer_recompute_device;
use strata_vmm::{Backend, Choice, Error};

/// Runs the device runtime for several splits; returns the largest |device − twin|.
fn worst_error(b: &Arc<dyn Backend>, d: &Data) -> f32 {
    let (s, h) = (d.seq, d.hidden);
    let mut worst = 0f32;
    for l in [0, 1, s / 3, s] {
        let kv = transfer_recompute_device(b, 0, &d.layer(), l).unwrap();
        let (k, v) = kv.read_back().unwrap();
        // Transferred rows are copies: exact whatever the data.
        assert!(k[l * h..] == d.k[l * h..] && v[l * h..] == d.v[l * h..]);
        for (got, want) in k.iter().zip(&d.k).chain(v.iter().zip(&d.v)) {
            worst = worst.max((got - want).abs());
        }
    }
    worst
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn cublas_recompute_merges_into_the_transferred_kv() {
    let b = match strata_vmm::open(Choice::Cuda) {
        Err(e @ (Error::NoDriver(_) | Error::NoDevice(_))) => {
            return println!("skipped: no CUDA device ({e})")
        }
        other => other.expect("the CUDA backend"),
    };
    assert_eq!(
        worst_error(&b, &Data::integers(96, 64)),
        0.0,
        "integer data: exact"
    );
    // |x|, |w| ≤ 0.5 over 128 terms: |K| ≤ 32; FP32 reordering error stays far below 1e-3.
    let worst = worst_error(&b, &Data::fractions(256, 128));
    assert!(
        worst < 1e-3,
        "fractional data: max |cuBLAS − twin| = {worst}"
    );
}
