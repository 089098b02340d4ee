//! KV growth latency with the background mapper off and on (issue 30 item 3): steady growth of
//! a few requests, one fresh page per tensor per append, with a decode step's gap between
//! rounds; prints the mean, p50, p99 and max of `KvSpace::grow` (what `strata_kv_append` and
//! `KvBlockManager::append` reach) for both, side by side, and for a third run whose pages are
//! already mapped (recycled slots, no mapper): the same loop's floor on this machine.
//!
//! Run: `STRATA_HOST_LATENCY=h200 cargo bench --bench kv_append` (options: `-- --rounds N`,
//! default 400, 150 with `--quick`; `--gap-us U`, the step gap, default 5000; `--zero-page`, spaces with the
//! zero page behind their tails, as `strata_kv_create` makes them). Without `--gap-us` and
//! `--zero-page` it prints four tables: 5 ms and 2 ms gaps, each without and with the zero page
//! (what `.ci/gpu-run`'s bench part records on a GPU in one call). The host backend charges the
//! profile's per-call costs (`strata-latency`); a 64 KiB granule keeps the memory small (costs
//! are per call). On the CUDA backend (`STRATA_BACKEND=cuda`) pages are the driver's granule.

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata::allocator::{KvConfig, KvSpace, PagePool, PoolConfig};
use strata::vmm::{self, HostConfig};

const LAYERS: u32 = 4;
const SLOTS: u32 = 4;
const TOKENS_PER_PAGE: u64 = 16;
const MAX_TOKENS: u32 = 1024;

struct Run {
    grows: Vec<Duration>,
    wall: Duration,
    from_ahead: u64,
    pages: u64,
    wakeups: u64,
}

fn quantile(v: &[Duration], q: f64) -> f64 {
    v[((v.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6
}

/// How the appends find their pages.
#[derive(Clone, Copy)]
enum Mode {
    /// Mapped by the append itself.
    Off,
    /// Mapped ahead by the background mapper with this budget (pages).
    On(usize),
    /// Already mapped (every request reuses a freed slot's pages, no mapper): the same loop
    /// with no driver call and no mapper, the machine's own floor for the append path.
    Recycled,
}

fn run(pool: &Arc<PagePool>, mode: Mode, rounds: usize, gap: Duration, zero_page: bool) -> Run {
    let page = pool.page_size();
    let mut space = KvSpace::new(
        Arc::clone(pool),
        KvConfig {
            layers: LAYERS,
            max_slots: SLOTS,
            max_tokens: MAX_TOKENS,
            bytes_per_token: page / TOKENS_PER_PAGE,
            zero_page,
        },
    )
    .expect("space");
    if let Mode::On(budget) = mode {
        space.start_map_ahead(budget).expect("map ahead");
    }
    let mut slots: Vec<_> = (0..SLOTS).map(|_| space.admit().expect("admit")).collect();
    let recycled = matches!(mode, Mode::Recycled);
    if recycled {
        for slot in &mut slots {
            space.grow(*slot, MAX_TOKENS).expect("grow");
            space.free(*slot).expect("free");
        }
        slots = (0..SLOTS).map(|_| space.admit().expect("admit")).collect();
    }
    let mut grows = Vec::with_capacity(rounds * SLOTS as usize);
    let block = TOKENS_PER_PAGE as u32;
    let started = Instant::now();
    for _ in 0..rounds {
        for slot in &mut slots {
            let tokens = space.tokens(*slot).expect("tokens");
            if tokens + block > MAX_TOKENS {
                // A finished request: its pages go back (stay mapped, recycled) and a new one
                // starts (not timed).
                if !recycled {
                    space.shrink(*slot, 0).expect("shrink");
                }
                space.free(*slot).expect("free");
                *slot = space.admit().expect("admit");
                continue;
            }
            let t = Instant::now();
            space.grow(*slot, tokens + block).expect("grow");
            grows.push(t.elapsed());
        }
        std::thread::sleep(gap);
    }
    let wall = started.elapsed();
    let s = space.stats();
    grows.sort();
    Run {
        grows,
        wall,
        from_ahead: s.pages_from_ahead,
        pages: s.pages_mapped_total,
        wakeups: s.mapper_wakeups,
    }
}

fn main() {
    let (mut rounds, mut gap_us, mut zero_page, mut quick) = (None, None, false, false);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--rounds" => {
                rounds = Some(
                    args.next()
                        .and_then(|v| v.parse().ok())
                        .expect("--rounds N"),
                )
            }
            "--gap-us" => {
                gap_us = Some(
                    args.next()
                        .and_then(|v| v.parse().ok())
                        .expect("--gap-us U"),
                )
            }
            "--zero-page" => zero_page = true,
            "--quick" => quick = true,
            _ => {} // cargo bench passes --bench
        }
    }
    let rounds = rounds.unwrap_or(if quick { 150 } else { 400 });
    let cases: Vec<(u64, bool)> = match gap_us {
        None if !zero_page => vec![(5000, false), (5000, true), (2000, false), (2000, true)],
        gap => vec![(gap.unwrap_or(5000), zero_page)],
    };
    let backend = vmm::host_or_cuda(HostConfig {
        devices: vec![4 << 30],
        granularity: 64 << 10,
        strict: false,
        link: None,
    })
    .expect("backend");
    let profile = match backend.as_any().downcast_ref::<vmm::HostBackend>() {
        Some(host) => host.latency().name.clone(),
        None => "(driver)".into(),
    };
    let pool = PagePool::new(
        Arc::clone(&backend),
        0,
        PoolConfig {
            low_watermark: 0,
            high_watermark: 1 << 20,
            limit: None,
            idle_trim_after: None,
            background: false,
        },
    )
    .expect("pool");
    for (gap_us, zero_page) in cases {
        let row = 2 * LAYERS as usize;
        println!(
            "backend {}, latency profile {profile}; {LAYERS} layers ({row} pages a row), {SLOTS} \
             requests, one fresh row per append, {rounds} rounds, {gap_us} µs between rounds, zero \
             page {}",
            backend.kind(),
            if zero_page { "on" } else { "off" }
        );
        println!(
            "| mapper | appends | mean µs | p50 µs | p95 µs | p99 µs | max µs | over 5 µs | pages \
             from ahead | mapper wake-ups | run s |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        let modes = [
            ("off", Mode::Off),
            ("on", Mode::On(4 * SLOTS as usize * row)),
            ("recycled (floor)", Mode::Recycled),
        ];
        for (name, mode) in modes {
            let r = run(
                &pool,
                mode,
                rounds,
                Duration::from_micros(gap_us),
                zero_page,
            );
            let mean = r.grows.iter().sum::<Duration>().as_secs_f64() * 1e6 / r.grows.len() as f64;
            println!(
                "| {name} | {} | {mean:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} of {} | {} | {:.3} |",
                r.grows.len(),
                quantile(&r.grows, 0.5),
                quantile(&r.grows, 0.95),
                quantile(&r.grows, 0.99),
                quantile(&r.grows, 1.0),
                r.grows.iter().filter(|d| d.as_micros() > 5).count(),
                r.from_ahead,
                r.pages,
                r.wakeups,
                r.wall.as_secs_f64()
            );
        }
        println!();
    }
}
