//! Unit and property tests of the exports, called directly as Rust functions (the integration
//! tests call the same functions through the built `libstrata.so`, from C, Python and Rust).
//!
//! The exports share process-wide state, so every test here takes [`SERIAL`]. The backend is
//! whatever the environment selects (the host backend in CI).

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

use parking_lot::Mutex;
use proptest::prelude::*;

use super::*;
use crate::stats::{strata_stats, strata_stats_t, strata_tag_stats, strata_tag_stats_t};
use crate::streams::{
    strata_memcpy_dtoh, strata_memcpy_htod, strata_stream_create, strata_stream_destroy,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn last() -> String {
    // SAFETY: strata_last_error never returns NULL and the string lives until our next call.
    unsafe { CStr::from_ptr(strata_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn stats(device: i32) -> strata_stats_t {
    let mut s = strata_stats_t::default();
    // SAFETY: `s` is a valid, writable strata_stats_t.
    let rc = unsafe { strata_stats(device, &mut s) };
    assert_eq!(rc, 0, "{}", last());
    s
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (seed
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(i as u64 * 131)
                >> 7) as u8
        })
        .collect()
}

fn write(ptr: *mut c_void, data: &[u8]) {
    // SAFETY: `data` is valid for its length during the call.
    let rc = unsafe { strata_memcpy_htod(ptr, data.as_ptr().cast(), data.len()) };
    assert_eq!(rc, 0, "{}", last());
}

fn read(ptr: *mut c_void, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    // SAFETY: `buf` is valid for writes of its length during the call.
    let rc = unsafe { strata_memcpy_dtoh(buf.as_mut_ptr().cast(), ptr, len) };
    assert_eq!(rc, 0, "{}", last());
    buf
}

fn push(name: &CStr) -> i32 {
    // SAFETY: a NUL-terminated string.
    unsafe { strata_tag_push(name.as_ptr()) }
}

#[test]
fn structs_have_the_header_layout() {
    assert_eq!(std::mem::size_of::<strata_stats_t>(), 232);
    assert_eq!(std::mem::align_of::<strata_stats_t>(), 8);
    assert_eq!(std::mem::size_of::<strata_tag_stats_t>(), 96);
    assert_eq!(std::mem::size_of::<Status>(), 4);
    assert_eq!(
        std::mem::size_of::<crate::params::strata_params_model_stats_t>(),
        128
    );
    assert_eq!(
        std::mem::size_of::<crate::harvest::strata_harvest_handle_t>(),
        32
    );
    assert_eq!(
        std::mem::size_of::<crate::harvest::strata_harvest_hints_t>(),
        24
    );
}

#[test]
fn malloc_free_round_trip_with_alignment_stats_and_contents() {
    let _s = SERIAL.lock();
    assert!(strata_device_count() >= 1, "{}", last());
    let before = stats(0);
    let mut ptrs = Vec::new();
    for (i, size) in [1usize, 255, 256, 4097, 1 << 20, (3 << 20) + 5]
        .into_iter()
        .enumerate()
    {
        let p = strata_malloc(size, 0, null_mut());
        assert!(!p.is_null(), "size {size}: {}", last());
        assert_eq!(p as usize % 256, 0, "alignment of {size}");
        let data = pattern(i as u64, size.min(8192));
        write(p, &data);
        ptrs.push((p, size, data));
    }
    let during = stats(0);
    let sum: u64 = ptrs.iter().map(|p| p.1 as u64).sum();
    assert_eq!(during.allocated_bytes, before.allocated_bytes + sum);
    assert_eq!(during.live_allocations, before.live_allocations + 6);
    assert_eq!(during.initialized, 1);
    assert!(during.reserved_bytes >= during.allocated_block_bytes);
    for (p, size, data) in ptrs {
        assert_eq!(read(p, data.len()), data);
        assert_eq!(strata_free_checked(p, size, 0, null_mut()), 0, "{}", last());
    }
    let after = stats(0);
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    assert_eq!(after.frees, before.frees + 6);
    assert!(strata_malloc(0, 0, null_mut()).is_null());
}

#[test]
fn bad_input_is_a_status_and_a_message_never_a_crash() {
    let _s = SERIAL.lock();
    strata_free(null_mut(), 0, 0, null_mut());
    assert_eq!(strata_free_checked(null_mut(), 8, 0, null_mut()), 0);

    strata_clear_error();
    assert!(strata_malloc(64, -1, null_mut()).is_null());
    assert!(last().contains("no such device -1"), "{}", last());
    assert!(strata_malloc(64, 1 << 20, null_mut()).is_null());
    assert!(last().contains("STRATA_NO_DEVICE"), "{}", last());
    for absurd in [usize::MAX, usize::MAX / 2, 1 << 60] {
        strata_clear_error();
        assert!(strata_malloc(absurd, 0, null_mut()).is_null());
        assert!(last().starts_with("strata_malloc: "), "{}", last());
    }

    let p = strata_malloc(1000, 0, null_mut());
    assert!(!p.is_null());
    let interior = (p as usize + 256) as *mut c_void;
    assert_eq!(
        strata_free_checked(interior, 0, 0, null_mut()),
        Status::UnknownPointer as i32
    );
    assert_eq!(
        strata_free_checked(0x1234_5000 as *mut c_void, 0, 0, null_mut()),
        Status::UnknownPointer as i32
    );
    assert_eq!(strata_free_checked(p, 1000, 0, null_mut()), 0);
    assert_eq!(
        strata_free_checked(p, 1000, 0, null_mut()),
        Status::DoubleFree as i32
    );
    strata_clear_error();
    strata_free(p, 1000, 0, null_mut());
    assert!(last().contains("double free"), "{}", last());
    assert_eq!(
        strata_free_checked(p, 1000, -3, null_mut()),
        Status::NoDevice as i32
    );

    // SAFETY: NULL and non-UTF-8 strings are allowed by the contracts (they are errors).
    unsafe {
        assert_eq!(strata_tag_push(std::ptr::null()), 3);
        assert_eq!(strata_tag_push([0xc3u8, 0x28, 0].as_ptr().cast()), 3);
        assert_eq!(strata_sleep(std::ptr::null(), 1), 3);
        assert_eq!(strata_wake(c"never-pushed".as_ptr()), 3);
        assert_eq!(strata_stats(0, null_mut()), 3);
        assert_eq!(strata_stats(-1, &mut strata_stats_t::default()), 10);
    }
    assert_eq!(push(c""), 3);
    let long = std::ffi::CString::new("x".repeat(300)).unwrap();
    assert_eq!(push(&long), 3);
    while strata_tag_depth() > 0 {
        strata_tag_pop();
    }
    assert_eq!(strata_tag_pop(), Status::InvalidState as i32);
    assert!(last().contains("tag stack is empty"));

    strata_clear_error();
    strata_set_memory_fraction(f64::NAN, 0);
    assert!(last().contains("memory fraction"), "{}", last());
    strata_clear_error();
    strata_record_stream(0x10 as *mut c_void, null_mut());
    assert!(last().contains("unknown pointer"), "{}", last());
    strata_clear_error();
    strata_init(-1);
    assert!(last().contains("negative"), "{}", last());
}

#[test]
fn memory_fraction_caps_reserved_bytes_and_one_lifts_it() {
    let _s = SERIAL.lock();
    strata_init(1);
    let total = stats(0).total_bytes;
    // A cap below what one more large block needs.
    strata_clear_error();
    let reserved = stats(0).reserved_bytes;
    let fraction = (reserved + (4 << 20)) as f64 / total as f64;
    strata_set_memory_fraction(fraction, 0);
    assert_eq!(last(), "");
    assert!(stats(0).limit_bytes > 0);
    let big = strata_malloc(64 << 20, 0, null_mut());
    assert!(big.is_null());
    assert!(last().contains("STRATA_LIMIT_EXCEEDED"), "{}", last());
    strata_set_memory_fraction(1.0, 0);
    assert_eq!(stats(0).limit_bytes, 0);
    let big = strata_malloc(64 << 20, 0, null_mut());
    assert!(!big.is_null(), "{}", last());
    strata_free(big, 64 << 20, 0, null_mut());
    strata_empty_cache();
    assert_eq!(stats(0).cached_large_bytes, 0);
}

#[test]
fn empty_cache_returns_the_host_pages_an_offload_left_in_the_host_pool() {
    let _serial = SERIAL.lock();
    let tag = c"empty-cache-host";
    assert_eq!(push(tag), 0, "{}", last());
    let p = strata_malloc(3 << 20, 0, null_mut());
    assert_eq!(strata_tag_pop(), 0);
    assert!(!p.is_null(), "{}", last());
    // SAFETY: a NUL-terminated tag; NULL is the default stream.
    unsafe {
        let rc =
            crate::offload::strata_offload(tag.as_ptr(), crate::offload::TIER_HOST, null_mut());
        assert_eq!(rc, 0, "{}", last());
        assert_eq!(
            crate::offload::strata_onload(tag.as_ptr(), null_mut()),
            0,
            "{}",
            last()
        );
    }
    let host = global::global().unwrap().devices()[0]
        .existing_host_pool()
        .expect("the offload created device 0's host pool");
    assert!(
        host.stats().free > 0,
        "the onload gave the host pages back to their pool"
    );
    strata_empty_cache();
    assert_eq!(host.stats().free, 0, "strata_empty_cache released them");
    strata_free(p, 0, 0, null_mut());
}

#[test]
fn tags_sleep_and_wake_keep_contents() {
    let _s = SERIAL.lock();
    assert_eq!(push(c"unit-weights"), 0);
    let small = strata_malloc(3000, 0, null_mut());
    let large = strata_malloc(5 << 20, 0, null_mut());
    assert_eq!(strata_tag_pop(), 0);
    assert!(!small.is_null() && !large.is_null(), "{}", last());
    let (a, b) = (pattern(7, 3000), pattern(8, 8192));
    write(small, &a);
    write(large, &b);
    let mut t = strata_tag_stats_t::default();
    // SAFETY: valid string and output.
    let rc = unsafe { strata_tag_stats(c"unit-weights".as_ptr(), 0, &mut t) };
    assert_eq!(rc, 0);
    assert_eq!(t.live_allocations, 2);
    assert_eq!(t.allocated_bytes, 3000 + (5 << 20));

    // SAFETY: valid strings.
    unsafe {
        assert_eq!(strata_sleep(c"unit-weights".as_ptr(), 1), 0, "{}", last());
        assert_eq!(
            strata_sleep(c"unit-weights".as_ptr(), 1),
            Status::InvalidState as i32
        );
        assert_eq!(strata_tag_stats(c"unit-weights".as_ptr(), 0, &mut t), 0);
    }
    assert_eq!(t.asleep, 1);
    assert_eq!(t.reserved_bytes, 0);
    assert_eq!(t.host_copy_bytes, 3000 + (5 << 20));
    assert_eq!(push(c"unit-weights"), 0);
    assert!(strata_malloc(64, 0, null_mut()).is_null());
    assert!(last().contains("STRATA_INVALID_STATE"), "{}", last());
    assert_eq!(strata_tag_pop(), 0);
    // SAFETY: valid string.
    let rc = unsafe { strata_wake(c"unit-weights".as_ptr()) };
    assert_eq!(rc, 0, "{}", last());
    assert_eq!(read(small, 3000), a);
    assert_eq!(read(large, 8192), b);
    // SAFETY: valid string.
    let rc = unsafe { strata_wake(c"unit-weights".as_ptr()) };
    assert_eq!(rc, Status::InvalidState as i32);
    strata_free(small, 3000, 0, null_mut());
    strata_free(large, 5 << 20, 0, null_mut());
}

// ---------------------------------------------------------------------------------------------
// Property test: random call sequences, valid and invalid, against a reference model.

#[derive(Clone, Debug)]
enum Op {
    Malloc {
        size: usize,
        device: i32,
        tag: usize,
    },
    Free {
        pick: usize,
        wrong_device: bool,
    },
    DoubleFree {
        pick: usize,
    },
    ForeignFree {
        offset: usize,
    },
    RecordStream {
        pick: usize,
    },
    Push {
        tag: usize,
    },
    Pop,
    Stats {
        device: i32,
    },
    EmptyCache,
    SleepWake {
        keep: bool,
    },
    BadString,
}

const TAGS: [&CStr; 3] = [c"fuzz-a", c"fuzz-b", c"fuzz-sleep"];

fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1usize..4096,
        2 => 4096usize..(1 << 20),
        2 => (1usize << 20)..(9 << 20),
        1 => Just(0usize),
        1 => prop_oneof![Just(usize::MAX), Just(1usize << 62), Just(usize::MAX - 255)],
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (size_strategy(), prop_oneof![8 => Just(0), 1 => Just(-1), 1 => Just(4096)], 0usize..4)
            .prop_map(|(size, device, tag)| Op::Malloc { size, device, tag }),
        6 => (any::<usize>(), prop::bool::weighted(0.1))
            .prop_map(|(pick, wrong_device)| Op::Free { pick, wrong_device }),
        1 => any::<usize>().prop_map(|pick| Op::DoubleFree { pick }),
        1 => (1usize..4096).prop_map(|offset| Op::ForeignFree { offset }),
        1 => any::<usize>().prop_map(|pick| Op::RecordStream { pick }),
        2 => (0usize..3).prop_map(|tag| Op::Push { tag }),
        2 => Just(Op::Pop),
        2 => prop_oneof![Just(0), Just(-1), Just(77)].prop_map(|device| Op::Stats { device }),
        1 => Just(Op::EmptyCache),
        1 => any::<bool>().prop_map(|keep| Op::SleepWake { keep }),
        1 => Just(Op::BadString),
    ]
}

struct Live {
    ptr: *mut c_void,
    size: usize,
    tag: usize,
    /// Pattern seed of the first bytes, or `None` when they must read as zeros.
    seed: Option<u64>,
}

const CHECKED: usize = 2048;

fn check_failure(rc: i32, expect: &[Status], what: &str) {
    assert!(
        expect.iter().any(|s| *s as i32 == rc),
        "{what}: status {rc}, expected {expect:?}; last error {}",
        last()
    );
    let msg = last();
    assert!(
        msg.contains(Status::from_code(rc).name()),
        "{what}: last error {msg:?} does not name status {rc}"
    );
}

fn run_ops(ops: &[Op]) {
    let devices = strata_device_count();
    assert!(devices >= 1);
    let stream = {
        let mut s: CudaStream = null_mut();
        // SAFETY: `s` is writable.
        assert_eq!(unsafe { strata_stream_create(0, &mut s) }, 0, "{}", last());
        s
    };
    // Register the tags so sleep can name them.
    for t in TAGS {
        assert_eq!(push(t), 0);
        assert_eq!(strata_tag_pop(), 0);
    }
    let base = stats(0);
    let mut live: Vec<Live> = Vec::new();
    let mut freed: Vec<*mut c_void> = Vec::new();
    let mut stack: Vec<usize> = Vec::new();
    let mut seed = 1u64;
    for op in ops {
        strata_clear_error();
        match *op {
            Op::Malloc { size, device, tag } => {
                let pushed = tag < 3;
                if pushed {
                    assert_eq!(push(TAGS[tag]), 0);
                }
                let s = if size % 3 == 0 { stream } else { null_mut() };
                let p = strata_malloc(size, device, s);
                let eff_tag = if pushed {
                    tag
                } else {
                    stack.last().copied().unwrap_or(9)
                };
                if pushed {
                    assert_eq!(strata_tag_pop(), 0);
                }
                let valid_device = device >= 0 && device < devices;
                if !valid_device {
                    assert!(p.is_null());
                    check_failure(Status::NoDevice as i32, &[Status::NoDevice], "bad device");
                } else if size == 0 {
                    assert!(p.is_null());
                } else if size > (1 << 40) {
                    assert!(p.is_null(), "absurd size {size} succeeded");
                    assert!(last().starts_with("strata_malloc: "), "{}", last());
                } else if p.is_null() {
                    // Out of memory is a normal outcome on a small device; it must say so.
                    assert!(
                        last().contains("STRATA_OUT_OF_MEMORY") || last().contains("LIMIT"),
                        "{}",
                        last()
                    );
                } else {
                    assert_eq!(p as usize % 256, 0);
                    assert_eq!(device, 0, "only device 0 is generated as valid");
                    assert!(live.iter().all(|l| l.ptr != p), "pointer handed out twice");
                    freed.retain(|&f| f != p);
                    seed += 1;
                    write(p, &pattern(seed, size.min(CHECKED)));
                    live.push(Live {
                        ptr: p,
                        size,
                        tag: eff_tag,
                        seed: Some(seed),
                    });
                }
            }
            Op::Free { pick, wrong_device } => {
                if live.is_empty() {
                    continue;
                }
                let l = live.swap_remove(pick % live.len());
                let expect = match l.seed {
                    Some(s) => pattern(s, l.size.min(CHECKED)),
                    None => vec![0u8; l.size.min(CHECKED)],
                };
                assert_eq!(read(l.ptr, expect.len()), expect, "contents of {:p}", l.ptr);
                if wrong_device {
                    let rc = strata_free_checked(l.ptr, l.size, -1, null_mut());
                    check_failure(rc, &[Status::NoDevice], "free with a bad device");
                }
                let s = if pick % 2 == 0 { stream } else { null_mut() };
                assert_eq!(strata_free_checked(l.ptr, l.size, 0, s), 0, "{}", last());
                freed.push(l.ptr);
            }
            Op::DoubleFree { pick } => {
                if freed.is_empty() {
                    continue;
                }
                let p = freed[pick % freed.len()];
                let rc = strata_free_checked(p, 0, 0, null_mut());
                check_failure(
                    rc,
                    &[Status::DoubleFree, Status::UnknownPointer],
                    "double free",
                );
            }
            Op::ForeignFree { offset } => {
                let target = match live.first() {
                    Some(l) => (l.ptr as usize + offset) as *mut c_void,
                    None => (0x1000_0000 + offset) as *mut c_void,
                };
                let rc = strata_free_checked(target, 0, 0, null_mut());
                check_failure(rc, &[Status::UnknownPointer, Status::DoubleFree], "foreign");
            }
            Op::RecordStream { pick } => {
                if let Some(l) = live.get(pick % live.len().max(1)) {
                    strata_record_stream(l.ptr, stream);
                    assert_eq!(last(), "");
                }
            }
            Op::Push { tag } => {
                assert_eq!(push(TAGS[tag]), 0);
                stack.push(tag);
            }
            Op::Pop => {
                let rc = strata_tag_pop();
                if stack.pop().is_some() {
                    assert_eq!(rc, 0);
                } else {
                    check_failure(rc, &[Status::InvalidState], "pop");
                }
            }
            Op::Stats { device } => {
                let mut s = strata_stats_t::default();
                // SAFETY: `s` is writable.
                let rc = unsafe { strata_stats(device, &mut s) };
                if device == 0 {
                    assert_eq!(rc, 0);
                } else {
                    check_failure(rc, &[Status::NoDevice], "stats of a bad device");
                }
            }
            Op::EmptyCache => {
                strata_empty_cache();
                assert_eq!(last(), "");
                let s = stats(0);
                assert_eq!(s.cached_large_bytes, 0);
            }
            Op::SleepWake { keep } => {
                let tag = TAGS[2];
                // SAFETY: valid strings.
                unsafe {
                    assert_eq!(strata_sleep(tag.as_ptr(), keep as i32), 0, "{}", last());
                    assert_eq!(push(tag), 0);
                    assert!(strata_malloc(512, 0, null_mut()).is_null());
                    check_failure(7, &[Status::InvalidState], "malloc while asleep");
                    assert_eq!(strata_tag_pop(), 0);
                    assert_eq!(strata_wake(tag.as_ptr()), 0, "{}", last());
                }
                if !keep {
                    for l in live.iter_mut().filter(|l| l.tag == 2) {
                        l.seed = None;
                    }
                }
            }
            Op::BadString => {
                // SAFETY: NULL is allowed by the contract.
                let rc = unsafe { strata_tag_push(std::ptr::null()) };
                check_failure(rc, &[Status::InvalidArgument], "NULL tag");
                assert_eq!(strata_tag_depth() as usize, stack.len());
            }
        }
        let s = stats(0);
        let sum: u64 = live.iter().map(|l| l.size as u64).sum();
        assert_eq!(
            s.allocated_bytes,
            base.allocated_bytes + sum,
            "after {op:?}"
        );
        assert_eq!(
            s.live_allocations,
            base.live_allocations + live.len() as u64
        );
        assert!(s.reserved_bytes >= s.allocated_block_bytes);
        assert_eq!(s.reserved_bytes, s.mapped_pages * s.page_size);
    }
    for l in live.drain(..) {
        assert_eq!(strata_free_checked(l.ptr, l.size, 0, null_mut()), 0);
    }
    while strata_tag_depth() > 0 {
        assert_eq!(strata_tag_pop(), 0);
    }
    assert_eq!(strata_stream_destroy(stream), 0, "{}", last());
    assert_eq!(stats(0).allocated_bytes, base.allocated_bytes);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_call_sequences_never_crash_and_keep_stats(ops in prop::collection::vec(op_strategy(), 1..150)) {
        let _s = SERIAL.lock();
        run_ops(&ops);
    }
}
