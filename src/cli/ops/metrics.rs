//! `strata metrics`: every process's figures in the Prometheus (OpenMetrics) text format,
//! printed once or served at `--listen ADDR` (`GET /metrics`), encoded by the Prometheus
//! project's own client library.

use std::process::ExitCode;

use clap::Args;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use strata_ops::{Listing, TierBytes};

use super::{failed, listing, rows};

#[derive(Args)]
pub struct MetricsArgs {
    /// Serve the metrics over HTTP at this address (`127.0.0.1:9464`) instead of printing
    /// them once; each scrape reads the processes anew.
    #[arg(long)]
    pub listen: Option<String>,
}

/// The OpenMetrics content type of the exposition.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;

/// One metric family: name (without unit or `_total`), help, unit, type, samples.
#[derive(Debug)]
struct Family {
    name: &'static str,
    help: &'static str,
    bytes: bool,
    counter: bool,
    samples: Vec<(Labels, u64)>,
}

impl Family {
    fn new(name: &'static str, help: &'static str, bytes: bool, counter: bool) -> Self {
        Family {
            name,
            help,
            bytes,
            counter,
            samples: Vec::new(),
        }
    }
}

/// The families of one listing (a fixed snapshot: the collector encodes what it was given).
#[derive(Debug)]
struct Snapshot(Vec<Family>);

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.0 {
            let unit = f.bytes.then_some(&Unit::Bytes);
            let kind = if f.counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            let mut metric = encoder.encode_descriptor(f.name, f.help, unit, kind)?;
            for (labels, value) in &f.samples {
                let family = metric.encode_family(labels)?;
                if f.counter {
                    ConstCounter::new(*value).encode(family)?;
                } else {
                    ConstGauge::new(*value).encode(family)?;
                }
            }
        }
        Ok(())
    }
}

fn tier_samples(family: &mut Family, base: &Labels, tiers: &TierBytes) {
    for (tier, bytes) in [
        ("device", tiers.device),
        ("peer", tiers.peer),
        ("host", tiers.host),
        ("disk", tiers.disk),
    ] {
        let mut labels = base.clone();
        labels.push(("tier", tier.to_string()));
        family.samples.push((labels, bytes));
    }
}

/// The exposition of `listing`.
pub fn render(listing: &Listing) -> String {
    use Family as F;
    let mut total = F::new("strata_device_memory", "Memory of the device", true, false);
    let mut reserved = F::new(
        "strata_reserved",
        "Bytes of pages the caching allocator holds mapped",
        true,
        false,
    );
    let mut allocated = F::new(
        "strata_allocated",
        "Requested bytes of live allocations",
        true,
        false,
    );
    let mut peak = F::new(
        "strata_peak_allocated",
        "Peak of allocated bytes",
        true,
        false,
    );
    let mut limit = F::new(
        "strata_limit",
        "Cap on the device memory strata holds (absent: none)",
        true,
        false,
    );
    let mut allocs = F::new("strata_allocations", "Allocations served", false, true);
    let mut frees = F::new("strata_frees", "Allocations freed", false, true);
    let mut ooms = F::new(
        "strata_out_of_memory",
        "Out-of-memory and limit failures",
        false,
        true,
    );
    let mut tiers = F::new(
        "strata_tier",
        "Bytes of the allocator's pages and KV blocks by tier",
        true,
        false,
    );
    let mut moved = F::new("strata_moved", "Bytes moved between tiers", true, true);
    let mut pool = F::new(
        "strata_pool_in_use",
        "Bytes of the device's pool pages in use",
        true,
        false,
    );
    let mut lent = F::new(
        "strata_lent",
        "Bytes of this device lent to peers",
        true,
        false,
    );
    let mut borrowed = F::new(
        "strata_borrowed",
        "Bytes of peers this device borrowed",
        true,
        false,
    );
    let mut tag_bytes = F::new(
        "strata_tag",
        "A tag's bytes by tier (state: awake, asleep, offloaded)",
        true,
        false,
    );
    let mut kv_tokens = F::new(
        "strata_kv_tokens",
        "Tokens held by a KV space's live requests",
        false,
        false,
    );
    let mut kv_bytes = F::new("strata_kv", "A KV space's blocks by tier", true, false);
    let mut kv_hits = F::new(
        "strata_kv_prefetch_hits",
        "KV restores done ahead of need",
        false,
        true,
    );
    let mut kv_misses = F::new(
        "strata_kv_prefetch_misses",
        "KV restores on demand",
        false,
        true,
    );
    for r in rows(listing) {
        let Some(d) = r.device else { continue };
        let base: Labels = vec![
            ("pid", r.process.pid.to_string()),
            ("library", r.process.library.clone()),
            ("command", r.process.command.clone()),
            ("device", d.device.to_string()),
        ];
        let put = |f: &mut Family, v: u64| f.samples.push((base.clone(), v));
        put(&mut total, d.total_bytes);
        put(&mut reserved, d.reserved_bytes);
        put(&mut allocated, d.allocated_bytes);
        put(&mut peak, d.peak_allocated_bytes);
        if let Some(l) = d.limit_bytes {
            put(&mut limit, l);
        }
        put(&mut allocs, d.allocs);
        put(&mut frees, d.frees);
        put(&mut ooms, d.ooms);
        put(&mut moved, d.moved_bytes);
        put(&mut pool, d.pool_in_use_bytes);
        put(&mut lent, d.lent_bytes);
        put(&mut borrowed, d.borrowed_bytes);
        tier_samples(&mut tiers, &base, &d.tiers);
        for t in &d.tags {
            let mut labels = base.clone();
            labels.push(("tag", t.name.clone()));
            labels.push(("state", t.state.as_str().to_string()));
            tier_samples(&mut tag_bytes, &labels, &t.bytes);
        }
        for k in &d.kv_spaces {
            let mut labels = base.clone();
            labels.push(("space", k.id.to_string()));
            kv_tokens.samples.push((labels.clone(), k.tokens));
            kv_hits.samples.push((labels.clone(), k.prefetch_hits));
            kv_misses.samples.push((labels.clone(), k.prefetch_misses));
            tier_samples(&mut kv_bytes, &labels, &k.bytes);
        }
    }
    let mut processes = F::new(
        "strata_processes",
        "Processes publishing figures",
        false,
        false,
    );
    processes
        .samples
        .push((Vec::new(), listing.processes.len() as u64));
    let families = [
        processes, total, reserved, allocated, peak, limit, allocs, frees, ooms, tiers, moved,
        pool, lent, borrowed, tag_bytes, kv_tokens, kv_bytes, kv_hits, kv_misses,
    ];
    let snapshot = Snapshot(families.into());
    let mut registry = Registry::default();
    registry.register_collector(Box::new(snapshot));
    let mut text = String::new();
    // Writing into a String cannot fail; a value above i64::MAX would (never a byte count).
    if prometheus_client::encoding::text::encode(&mut text, &registry).is_err() {
        text.clear();
    }
    text
}

pub fn run(args: MetricsArgs) -> Result<ExitCode, strata::Error> {
    let Some(addr) = args.listen else {
        return match listing() {
            Ok((_, l)) => {
                print!("{}", render(&l));
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => failed(e),
        };
    };
    let server = match tiny_http::Server::http(&addr) {
        Ok(s) => s,
        Err(e) => return failed(format!("cannot listen on {addr}: {e}")),
    };
    let Ok(content_type) = tiny_http::Header::from_bytes("Content-Type", CONTENT_TYPE) else {
        return failed("bad content type header");
    };
    eprintln!("strata: serving metrics at http://{addr}/metrics");
    for request in server.incoming_requests() {
        let response = if request.url() == "/metrics" || request.url() == "/" {
            match listing() {
                Ok((_, l)) => {
                    tiny_http::Response::from_string(render(&l)).with_header(content_type.clone())
                }
                Err(e) => tiny_http::Response::from_string(e.to_string()).with_status_code(500),
            }
        } else {
            tiny_http::Response::from_string("not found: try /metrics").with_status_code(404)
        };
        // A client gone before the answer is its business.
        let _ = request.respond(response);
    }
    Ok(ExitCode::SUCCESS)
}
