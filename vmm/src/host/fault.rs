//! Fault injection: fail the Nth subsequent call of an operation, before it changes any state;
//! and gates: a test's hook run before an operation (to hold it, e.g. while a test checks what
//! other threads can do meanwhile, or to make it slow).

use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// An operation of the host backend that can be made to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultOp {
    /// `create`.
    Create,
    /// `map`.
    Map,
    /// `set_access`.
    SetAccess,
    /// `copy_async` and `memset_async` (at submission).
    Copy,
    /// `unmap` (the range stays mapped).
    Unmap,
}

impl FaultOp {
    const ALL: [FaultOp; 5] = [
        FaultOp::Create,
        FaultOp::Map,
        FaultOp::SetAccess,
        FaultOp::Copy,
        FaultOp::Unmap,
    ];

    /// The name carried by [`Error::InjectedFault`].
    pub fn name(self) -> &'static str {
        match self {
            FaultOp::Create => "create",
            FaultOp::Map => "map",
            FaultOp::SetAccess => "set_access",
            FaultOp::Copy => "copy",
            FaultOp::Unmap => "unmap",
        }
    }

    fn index(self) -> usize {
        match self {
            FaultOp::Create => 0,
            FaultOp::Map => 1,
            FaultOp::SetAccess => 2,
            FaultOp::Copy => 3,
            FaultOp::Unmap => 4,
        }
    }
}

/// A hook run at the start of an operation, before the backend takes any lock, on the calling
/// thread (see [`HostBackend::set_op_gate`](super::HostBackend::set_op_gate)).
pub type OpGate = Arc<dyn Fn(FaultOp) + Send + Sync>;

/// Armed faults: for each operation, how many calls remain until the one that fails (0: none),
/// and its gate.
#[derive(Default)]
pub(crate) struct FaultPlan {
    countdown: Mutex<[u64; FaultOp::ALL.len()]>,
    gates: Mutex<[Option<OpGate>; FaultOp::ALL.len()]>,
}

impl FaultPlan {
    /// Makes the `nth` subsequent call of `op` fail (`nth` 0 or 1: the next one). Replaces an
    /// earlier plan for the same operation.
    pub(crate) fn arm(&self, op: FaultOp, nth: u64) {
        self.countdown.lock()[op.index()] = nth.max(1);
    }

    /// Disarms every fault.
    pub(crate) fn clear(&self) {
        *self.countdown.lock() = [0; FaultOp::ALL.len()];
    }

    /// Sets (or, with `None`, removes) the gate of `op`.
    pub(crate) fn set_gate(&self, op: FaultOp, gate: Option<OpGate>) {
        self.gates.lock()[op.index()] = gate;
    }

    /// Runs the gate of `op` (with no lock held), then counts one call of `op`; fails when it
    /// is the armed one (which disarms it).
    pub(crate) fn check(&self, op: FaultOp) -> Result<()> {
        let gate = self.gates.lock()[op.index()].clone();
        if let Some(gate) = gate {
            gate(op);
        }
        let mut countdown = self.countdown.lock();
        let slot = &mut countdown[op.index()];
        match *slot {
            0 => Ok(()),
            1 => {
                *slot = 0;
                Err(Error::InjectedFault(op.name()))
            }
            n => {
                *slot = n - 1;
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nth_call_fails_once() {
        let plan = FaultPlan::default();
        plan.arm(FaultOp::Map, 3);
        assert!(plan.check(FaultOp::Map).is_ok());
        assert!(plan.check(FaultOp::Create).is_ok());
        assert!(plan.check(FaultOp::Map).is_ok());
        assert!(matches!(
            plan.check(FaultOp::Map),
            Err(Error::InjectedFault("map"))
        ));
        assert!(plan.check(FaultOp::Map).is_ok());
        plan.arm(FaultOp::Copy, 1);
        plan.clear();
        assert!(plan.check(FaultOp::Copy).is_ok());
    }

    #[test]
    fn gate_runs_before_its_operation_only() {
        let plan = FaultPlan::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        plan.set_gate(FaultOp::Map, Some(Arc::new(move |op| log.lock().push(op))));
        plan.arm(FaultOp::Map, 1);
        assert!(plan.check(FaultOp::Create).is_ok());
        assert!(plan.check(FaultOp::Map).is_err()); // the gate runs before the fault
        plan.set_gate(FaultOp::Map, None);
        assert!(plan.check(FaultOp::Map).is_ok());
        assert_eq!(*seen.lock(), vec![FaultOp::Map]);
    }
}
