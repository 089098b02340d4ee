//! Fault injection: fail the Nth subsequent call of an operation, before it changes any state.

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
}

impl FaultOp {
    const ALL: [FaultOp; 4] = [
        FaultOp::Create,
        FaultOp::Map,
        FaultOp::SetAccess,
        FaultOp::Copy,
    ];

    /// The name carried by [`Error::InjectedFault`].
    pub fn name(self) -> &'static str {
        match self {
            FaultOp::Create => "create",
            FaultOp::Map => "map",
            FaultOp::SetAccess => "set_access",
            FaultOp::Copy => "copy",
        }
    }

    fn index(self) -> usize {
        match self {
            FaultOp::Create => 0,
            FaultOp::Map => 1,
            FaultOp::SetAccess => 2,
            FaultOp::Copy => 3,
        }
    }
}

/// Armed faults: for each operation, how many calls remain until the one that fails (0: none).
#[derive(Debug, Default)]
pub(crate) struct FaultPlan {
    countdown: Mutex<[u64; FaultOp::ALL.len()]>,
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

    /// Counts one call of `op`; fails when it is the armed one (which disarms it).
    pub(crate) fn check(&self, op: FaultOp) -> Result<()> {
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
}
