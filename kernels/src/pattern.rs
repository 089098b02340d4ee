//! Deterministic fill patterns: every byte depends on a seed and its offset, so a block that was
//! moved, torn, or swapped with another is detected when checked.

/// Fills `buf` with the pattern of `seed`, as if it started at byte `offset` of the object.
pub fn fill(buf: &mut [u8], seed: u64, offset: u64) {
    let mut word_index = offset / 8;
    let mut skip = (offset % 8) as usize;
    let mut out = buf.iter_mut();
    loop {
        let word = word_at(seed, word_index).to_le_bytes();
        for &b in &word[skip..] {
            match out.next() {
                Some(slot) => *slot = b,
                None => return,
            }
        }
        skip = 0;
        word_index += 1;
    }
}

/// Returns the offset (within `buf`) of the first byte that differs from the pattern, if any.
pub fn first_mismatch(buf: &[u8], seed: u64, offset: u64) -> Option<usize> {
    let mut expected = vec![0u8; buf.len().min(1 << 16)];
    let mut done = 0usize;
    while done < buf.len() {
        let n = expected.len().min(buf.len() - done);
        fill(&mut expected[..n], seed, offset + done as u64);
        if let Some(i) = buf[done..done + n]
            .iter()
            .zip(&expected[..n])
            .position(|(a, b)| a != b)
        {
            return Some(done + i);
        }
        done += n;
    }
    None
}

/// A 64-bit FNV-1a checksum of `buf`.
pub fn checksum(buf: &[u8]) -> u64 {
    buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x1000_0000_01b3)
    })
}

fn word_at(seed: u64, index: u64) -> u64 {
    // SplitMix64 of (seed, index): cheap, and distinct seeds give unrelated streams.
    let mut z =
        seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ index.wrapping_add(0x6a09_e667_f3bc_c909);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_is_position_dependent_and_checkable() {
        let mut whole = vec![0u8; 100];
        fill(&mut whole, 7, 0);
        let mut tail = vec![0u8; 37];
        fill(&mut tail, 7, 63);
        assert_eq!(&whole[63..], &tail[..]);
        assert_eq!(first_mismatch(&whole, 7, 0), None);
        assert_eq!(first_mismatch(&whole, 8, 0), Some(0));
        whole[50] ^= 1;
        assert_eq!(first_mismatch(&whole, 7, 0), Some(50));
    }

    #[test]
    fn checksum_sees_single_bit_flips() {
        let mut buf = vec![0u8; 4096];
        fill(&mut buf, 1, 0);
        let before = checksum(&buf);
        buf[4095] ^= 0x80;
        assert_ne!(before, checksum(&buf));
    }
}
