//! Unit tests of `vatable.rs`.

use super::*;

const G: u64 = 0x1000;
const H: PhysHandle = PhysHandle(7);
const D0: Location = Location::Device(0);
const D1: Location = Location::Device(1);

fn table() -> VaTable {
    let mut t = VaTable::new();
    t.add_reservation(0x10_0000, 16 * G).unwrap();
    t
}

#[test]
fn reserve_arguments() {
    assert!(matches!(
        VaTable::check_reserve(0, 0, G),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        VaTable::check_reserve(G + 1, 0, G),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        VaTable::check_reserve(G, G / 2, G),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        VaTable::check_reserve(u64::MAX - G + 1, 2 * G, G),
        Err(Error::Overflow(_))
    ));
    assert_eq!(VaTable::check_reserve(G, 0, G).unwrap(), G);
    assert_eq!(VaTable::check_reserve(G, 4 * G, G).unwrap(), 4 * G);
}

#[test]
fn overlapping_reservations_are_refused() {
    let mut t = table();
    assert!(t.add_reservation(0x10_0000 + G, G).is_err());
    assert!(t.add_reservation(0x10_0000 - G, 2 * G).is_err());
    t.add_reservation(0x10_0000 + 16 * G, G).unwrap();
    assert_eq!(t.reservation_count(), 2);
}

#[test]
fn free_needs_exact_pair_and_no_mappings() {
    let mut t = table();
    let base = 0x10_0000;
    assert!(matches!(
        t.check_free(base + G, 15 * G),
        Err(Error::NotReserved { .. })
    ));
    assert!(matches!(
        t.check_free(base, 8 * G),
        Err(Error::InvalidArgument(_))
    ));
    t.insert_mapping(base, G, H, 0, G, G).unwrap();
    assert!(matches!(
        t.check_free(base, 16 * G),
        Err(Error::StillMapped { .. })
    ));
    t.remove_mappings(base, G, G).unwrap();
    t.remove_reservation(base, 16 * G).unwrap();
    assert_eq!(t.reservation_count(), 0);
    t.check_invariants().unwrap();
}

#[test]
fn map_rules() {
    let mut t = table();
    let base = 0x10_0000;
    assert!(matches!(
        t.check_map(base, 0, 0, G, G),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        t.check_map(base + 1, G, 0, G, G),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        t.check_map(base, G + 1, 0, 2 * G, G),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        t.check_map(base, G, 1, 2 * G, G),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        t.check_map(base, 2 * G, 0, G, G),
        Err(Error::InvalidArgument(_))
    ));
    // A non-zero offset: the real driver refuses it (CUDA_ERROR_NOT_SUPPORTED).
    assert!(matches!(
        t.check_map(base, G, G, 2 * G, G),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        t.check_map(base, G, u64::MAX - G + 1, u64::MAX, G),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        t.check_map(u64::MAX - G + 1, 2 * G, 0, 4 * G, G),
        Err(Error::Overflow(_))
    ));
    assert!(matches!(
        t.check_map(0, G, 0, G, G),
        Err(Error::NotReserved { .. })
    ));
    assert!(matches!(
        t.check_map(base + 15 * G, 2 * G, 0, 2 * G, G),
        Err(Error::NotReserved { .. })
    ));
    t.insert_mapping(base + 2 * G, 2 * G, H, 0, 2 * G, G)
        .unwrap();
    assert!(matches!(
        t.check_map(base + 3 * G, G, 0, G, G),
        Err(Error::AlreadyMapped { .. })
    ));
    assert!(matches!(
        t.check_map(base + G, 2 * G, 0, 2 * G, G),
        Err(Error::AlreadyMapped { .. })
    ));
    t.check_map(base + 4 * G, G, 0, G, G).unwrap();
    t.check_map(base, 2 * G, 0, 2 * G, G).unwrap();
    assert_eq!(t.mapping_count(), 1);
    t.check_invariants().unwrap();
}

#[test]
fn unmap_rules() {
    let mut t = table();
    let base = 0x10_0000;
    t.insert_mapping(base, 2 * G, H, 0, 2 * G, G).unwrap();
    t.insert_mapping(base + 2 * G, 2 * G, H, 0, 2 * G, G)
        .unwrap();
    t.insert_mapping(base + 6 * G, G, H, 0, 2 * G, G).unwrap();
    assert!(matches!(
        t.check_unmap(base, G, G),
        Err(Error::PartialUnmap { .. })
    ));
    assert!(matches!(
        t.check_unmap(base + G, 2 * G, G),
        Err(Error::PartialUnmap { .. })
    ));
    assert!(matches!(
        t.check_unmap(base + 2 * G, 5 * G, G),
        Err(Error::NotMapped { .. })
    ));
    assert!(matches!(
        t.check_unmap(base + 8 * G, G, G),
        Err(Error::NotMapped { .. })
    ));
    assert!(matches!(
        t.check_unmap(base + 15 * G, 2 * G, G),
        Err(Error::NotReserved { .. })
    ));
    let removed = t.remove_mappings(base, 4 * G, G).unwrap();
    assert_eq!(removed.len(), 2);
    assert_eq!(t.mapping_count(), 1);
    t.check_invariants().unwrap();
}

#[test]
fn set_access_needs_full_mapping_and_splits_runs() {
    let mut t = table();
    let base = 0x10_0000;
    t.insert_mapping(base, 4 * G, H, 0, 4 * G, G).unwrap();
    t.insert_mapping(base + 4 * G, 2 * G, H, 0, 2 * G, G)
        .unwrap();
    assert!(matches!(
        t.set_access(base, 8 * G, &[(D0, Access::ReadWrite)], G),
        Err(Error::NotMapped { .. })
    ));
    assert!(matches!(
        t.set_access(base + 8 * G, G, &[(D0, Access::ReadWrite)], G),
        Err(Error::NotMapped { .. })
    ));
    assert!(matches!(
        t.set_access(base, G, &[], G),
        Err(Error::InvalidArgument(_))
    ));
    let runs = t
        .set_access(base + G, 4 * G, &[(D0, Access::Read)], G)
        .unwrap();
    assert_eq!(runs, vec![(base + G, 4 * G, Access::Read)]);
    t.check_invariants().unwrap();
    // Upgrade part of the run, revoke elsewhere.
    let runs = t
        .set_access(
            base,
            2 * G,
            &[(D0, Access::ReadWrite), (D1, Access::Read)],
            G,
        )
        .unwrap();
    assert_eq!(runs, vec![(base, 2 * G, Access::ReadWrite)]);
    t.check_invariants().unwrap();
    assert_eq!(
        t.mapping_at(base).unwrap().access_at(base).get(D1),
        Access::Read
    );
    assert_eq!(
        t.mapping_at(base + 3 * G)
            .unwrap()
            .access_at(base + 3 * G)
            .get(D1),
        Access::None
    );
    t.set_access(base, 6 * G, &[(D0, Access::None), (D1, Access::None)], G)
        .unwrap();
    assert_eq!(
        t.mapping_at(base).unwrap().access,
        t.mapping_at(base).unwrap().access[..1]
    );
    assert_eq!(
        t.mapping_at(base).unwrap().access_at(base).strongest(),
        Access::None
    );
    t.check_invariants().unwrap();
}

#[test]
fn translate_pieces_and_access() {
    let mut t = table();
    let base = 0x10_0000;
    t.insert_mapping(base, 2 * G, H, 0, 8 * G, G).unwrap();
    t.insert_mapping(base + 2 * G, G, PhysHandle(9), 0, G, G)
        .unwrap();
    // Fresh mappings have no access.
    assert!(matches!(
        t.translate(base, 10, Accessor::Any, Access::Read),
        Err(Error::IllegalAccess { .. })
    ));
    t.set_access(base, 3 * G, &[(D1, Access::Read)], G).unwrap();
    assert!(t
        .translate(base, 10, Accessor::Location(D1), Access::Read)
        .is_ok());
    assert!(t
        .translate(base, 10, Accessor::Location(D0), Access::Read)
        .is_err());
    assert!(t
        .translate(base, 10, Accessor::Any, Access::ReadWrite)
        .is_err());
    let got = t
        .translate(base + G, 2 * G, Accessor::Any, Access::Read)
        .unwrap();
    assert_eq!(
        got,
        Translation::Device(vec![
            Piece {
                handle: H,
                offset: G,
                len: G
            },
            Piece {
                handle: PhysHandle(9),
                offset: 0,
                len: G
            },
        ])
    );
    // Holes, boundary crossing, host memory.
    assert!(t
        .translate(base + 2 * G, 2 * G, Accessor::Any, Access::Read)
        .is_err());
    assert!(t
        .translate(base - 8, 16, Accessor::Any, Access::Read)
        .is_err());
    assert!(t
        .translate(base + 15 * G, 2 * G, Accessor::Any, Access::Read)
        .is_err());
    assert_eq!(
        t.translate(0x1000, 64, Accessor::Any, Access::Read)
            .unwrap(),
        Translation::Host
    );
    assert_eq!(
        t.translate(base + 16 * G, 64, Accessor::Any, Access::Read)
            .unwrap(),
        Translation::Host
    );
    assert!(matches!(
        t.translate(u64::MAX, 2, Accessor::Any, Access::Read),
        Err(Error::Overflow(_))
    ));
}

#[test]
fn block_launch_rule_compares_the_memory_itself() {
    let mut t = table();
    let (a, b) = (0x10_0000u64, 0x10_0000 + 4 * G);
    // One handle mapped at two VAs: `a` and `b` show the same bytes.
    t.insert_mapping(a, 2 * G, H, 0, 2 * G, G).unwrap();
    t.insert_mapping(b, 2 * G, H, 0, 2 * G, G).unwrap();
    t.set_access(a, 2 * G, &[(D0, Access::ReadWrite)], G)
        .unwrap();
    t.set_access(b, 2 * G, &[(D0, Access::ReadWrite)], G)
        .unwrap();
    let d0 = Accessor::Location(D0);
    let host = 0x7f00_0000_0000u64;
    // Disjoint device ranges and host ranges: fine; the host ranges come back.
    let got = t
        .check_blocks(d0, 64, &[(a, a + G), (host, a + 64)])
        .unwrap();
    assert_eq!(got, vec![(host, 64)]);
    // A destination over another destination, over a source, and over a source seen
    // through the second VA of the same handle.
    for pairs in [
        [(host, a), (host + 64, a + 32)],
        [(a, a + 32), (host, a + G)],
        [(a, b + 16), (host, a + G)],
    ] {
        assert!(
            matches!(
                t.check_blocks(d0, 64, &pairs),
                Err(Error::InvalidArgument(_))
            ),
            "{pairs:x?}"
        );
    }
    // Host destinations overlap in host memory too.
    assert!(matches!(
        t.check_blocks(d0, 64, &[(a, host), (a + 64, host + 8)]),
        Err(Error::InvalidArgument(_))
    ));
    // Access, null host pointers, overflow; zero length is nothing to check.
    assert!(matches!(
        t.check_blocks(Accessor::Location(D1), 64, &[(a, host)]),
        Err(Error::IllegalAccess { .. })
    ));
    assert!(matches!(
        t.check_blocks(d0, 64, &[(0, a)]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        t.check_blocks(d0, 64, &[(u64::MAX - 8, a)]),
        Err(Error::Overflow(_))
    ));
    assert!(matches!(
        t.check_blocks(d0, u64::MAX, &[(a, host), (host, a)]),
        Err(Error::Overflow(_))
    ));
    assert_eq!(t.check_blocks(d0, 0, &[(a, a)]).unwrap(), vec![]);
}
