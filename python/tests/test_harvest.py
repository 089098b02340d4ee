"""strata.harvest through ctypes: peer allocations, contents, revocation callbacks (once, with
`lost` for lossy data), stale handles, out of memory as a typed exception."""

import unittest

import strata
from strata import harvest


class HarvestTest(unittest.TestCase):
    def test_revoke_calls_back_once_and_leaves_the_handle_stale(self):
        for durability, lost in (("lossy", True), ("backed", False)):
            a = harvest.alloc(3 << 20, requester=0, durability=durability)
            self.assertGreaterEqual(a.size, 3 << 20)
            data = bytes(range(256)) * 64
            a.write(4096, data)
            self.assertEqual(a.read(4096, len(data)), data)
            calls = []
            a.on_revoke(lambda alloc, was_lost: calls.append((alloc.id, was_lost)))
            self.assertGreaterEqual(harvest.reclaim(a.device, a.size), a.size)
            self.assertEqual(calls, [(a.id, lost)])
            with self.assertRaises(strata.StaleHandle):
                a.read(0, 16)
            with self.assertRaises(strata.StaleHandle):
                a.free()
            self.assertEqual(calls, [(a.id, lost)])

    def test_free_runs_no_callback_and_bad_input_is_typed(self):
        a = harvest.alloc(1 << 20, durability="lossy")
        calls = []
        a.on_revoke(lambda alloc, was_lost: calls.append(was_lost))
        a.free()
        self.assertEqual(calls, [])
        with self.assertRaises(strata.StaleHandle):
            a.free()
        with self.assertRaises(strata.OutOfMemory):
            harvest.alloc(1 << 44)
        with self.assertRaises(strata.InvalidArgument):
            harvest.alloc(1 << 20, durability="sometimes")

    def test_integers_beyond_the_c_types_are_refused(self):
        a = harvest.alloc(1 << 20, durability="lossy")
        data = bytes(range(256)) * 16
        a.write(0, data)
        calls = [
            (a.read, 0, -1), (a.read, 0, 2**62), (a.read, -1, 16), (a.read, 2**64, 16),
            (a.write, -1, b"x"), (a.write, 2**64, b"x"), (harvest.alloc, -1), (harvest.alloc, 2**64),
            (harvest.alloc, 1 << 20, 2**31), (harvest.reclaim, 0, -1), (harvest.reclaim, 2**32, 1),
        ]
        for fn, *args in calls:
            with self.assertRaises(strata.InvalidArgument, msg=(fn.__name__, args)):
                fn(*args)
        with self.assertRaisesRegex(strata.InvalidArgument, "length"):
            a.read(0, 2**62)
        self.assertEqual(a.read(0, len(data)), data)
        a.free()


if __name__ == "__main__":
    unittest.main()
