pub mod bench;
pub mod chart;
pub mod demo;
pub mod info;
pub mod ops;
pub mod replay;
pub mod sim;
pub mod sim_kvpr;
pub mod sim_mirage;
pub mod sim_pie;

/// Human-readable binary size (`1.5 GiB`).
pub fn size(bytes: u64) -> String {
    bytesize::ByteSize::b(bytes).display().iec().to_string()
}
