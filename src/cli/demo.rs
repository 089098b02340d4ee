//! `strata demo` (filled in once KvSpace and the caching allocator land).

use std::process::ExitCode;

#[derive(clap::Args)]
pub struct DemoArgs {}

pub fn run(_args: DemoArgs) -> Result<ExitCode, strata::Error> {
    Ok(ExitCode::SUCCESS)
}
