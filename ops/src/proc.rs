//! What `/proc` says about a process.

/// When process `pid` started, in clock ticks after boot (field 22 of `/proc/<pid>/stat`);
/// `None` when it does not exist (any more).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces and ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The command name of process `pid` (`/proc/<pid>/comm`), or empty.
pub fn command(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim_end().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_has_a_start_and_a_dead_pid_has_none() {
        let me = std::process::id();
        assert!(super::start_ticks(me).is_some());
        assert_eq!(super::start_ticks(me), super::start_ticks(me));
        assert!(!super::command(me).is_empty());
        // Above the kernel's pid_max (at most 2^22).
        assert_eq!(super::start_ticks((1 << 22) + 1), None);
    }
}
