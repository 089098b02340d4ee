//! The pure peer choice: best fit (least leftover) after link and hint preference.

/// One candidate peer as the controller sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub device: u32,
    /// Bytes that may be lent from it now (free − reserve, capped by the quota left).
    pub harvestable: u64,
    /// Directly linked to the requester.
    pub direct: bool,
    /// Named in the allocation's hints.
    pub preferred: bool,
}

/// Chooses the peer for `size` bytes: among candidates that fit, directly linked ones first,
/// then hinted ones, then the least leftover (`harvestable − size`), then the lowest ordinal.
/// `None` when no candidate fits.
pub fn choose(candidates: &[Candidate], size: u64, direct_only: bool) -> Option<u32> {
    rank(candidates, size, direct_only).first().copied()
}

/// Every candidate that fits, best first (the order [`choose`] picks in); the controller
/// falls through to the next one when a peer runs out of memory between check and take.
pub fn rank(candidates: &[Candidate], size: u64, direct_only: bool) -> Vec<u32> {
    let mut fits: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.harvestable >= size && (c.direct || !direct_only))
        .collect();
    fits.sort_by_key(|c| (!c.direct, !c.preferred, c.harvestable - size, c.device));
    fits.into_iter().map(|c| c.device).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(device: u32, harvestable: u64, direct: bool, preferred: bool) -> Candidate {
        Candidate {
            device,
            harvestable,
            direct,
            preferred,
        }
    }

    #[test]
    fn least_leftover_wins() {
        let cs = [
            c(1, 100, true, false),
            c(2, 40, true, false),
            c(3, 60, true, false),
        ];
        assert_eq!(choose(&cs, 30, false), Some(2));
        assert_eq!(choose(&cs, 50, false), Some(3));
        assert_eq!(choose(&cs, 70, false), Some(1));
        assert_eq!(choose(&cs, 101, false), None);
    }

    #[test]
    fn links_then_hints_then_fit() {
        let cs = [
            c(1, 40, false, false),
            c(2, 100, true, false),
            c(3, 90, true, true),
        ];
        assert_eq!(
            choose(&cs, 30, false),
            Some(3),
            "hinted direct peer beats a tighter fit"
        );
        let cs = [c(1, 40, false, true), c(2, 100, true, false)];
        assert_eq!(
            choose(&cs, 30, false),
            Some(2),
            "a direct link beats a hint"
        );
        assert_eq!(choose(&cs, 200, false), None);
        let cs = [c(1, 40, false, false)];
        assert_eq!(choose(&cs, 30, false), Some(1));
        assert_eq!(choose(&cs, 30, true), None);
        let cs = [c(4, 50, true, false), c(2, 50, true, false)];
        assert_eq!(
            choose(&cs, 50, false),
            Some(2),
            "ties go to the lowest ordinal"
        );
    }
}
