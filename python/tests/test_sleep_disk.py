"""Sleep to disk and wake through the Python package (ctypes, strict mode): contents kept in a
file come back at the same addresses; a missing directory is a typed error with the tag awake."""

import os
import tempfile
import unittest

import strata
from strata import _lib


def pattern(seed, n):
    period = bytes((seed * 131 + i * 7) % 251 for i in range(251))  # i * 7 mod 251: period 251
    return (period * (n // 251 + 1))[:n]


class SleepToDiskTest(unittest.TestCase):
    def test_sleep_to_disk_and_wake_keep_contents(self):
        with tempfile.TemporaryDirectory() as d:
            with strata.tag("disk-sleeper"):
                ptrs = [(_lib.malloc(n), n, seed) for seed, n in enumerate((5000, 3 << 20, 17 << 20))]
            for p, n, seed in ptrs:
                _lib.memcpy_htod(p, pattern(seed, n))
            before = strata.stats(0)["reserved_bytes"]
            strata.sleep("disk-sleeper", disk_dir=d)
            self.assertEqual(strata.tag_stats("disk-sleeper")["asleep"], 1)
            self.assertEqual(strata.tag_stats("disk-sleeper")["host_copy_bytes"], 0)
            self.assertLess(strata.stats(0)["reserved_bytes"], before)
            self.assertEqual(os.listdir(d), [])  # the file is unlinked at once
            strata.wake("disk-sleeper")
            for p, n, seed in ptrs:
                self.assertEqual(_lib.memcpy_dtoh(p, n), pattern(seed, n))
            with self.assertRaises(strata.StrataError) as ctx:
                strata.sleep("disk-sleeper", disk_dir=os.path.join(d, "missing"))
            self.assertEqual(ctx.exception.status_name, "STRATA_OS")
            self.assertEqual(strata.tag_stats("disk-sleeper")["asleep"], 0)
            for p, n, seed in ptrs:
                self.assertEqual(_lib.memcpy_dtoh(p, n), pattern(seed, n))
                _lib.free(p)


if __name__ == "__main__":
    unittest.main()
