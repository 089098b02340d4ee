"""strata.vllm.control (KV limits from outside an engine) without vLLM: sizes, the folder's
listing of live and dead engines, and the CLI's refusals. The engine side runs in
python/tests/vllm/test_vllm.py."""

import json
import os
import tempfile
import unittest

from strata.vllm import control


class Sizes(unittest.TestCase):
    def test_sizes_in_bytes_binary_and_decimal_units(self):
        self.assertEqual(control.parse_limit("1048576"), 1 << 20)
        self.assertEqual(control.parse_limit("512MiB"), 512 << 20)
        self.assertEqual(control.parse_limit(" 1.5GiB\n"), 3 << 29)
        self.assertEqual(control.parse_limit("2GB"), 2 * 10**9)
        self.assertEqual(control.parse_limit("64 kib"), 64 << 10)
        self.assertIsNone(control.parse_limit("None"))

    def test_bad_sizes_are_refused(self):
        for text in ("", "-1", "12 parsecs", "1e9", "MiB", "1.5.2GiB"):
            with self.assertRaises(control.ControlError, msg=text):
                control.parse_limit(text)


class Folder(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def publish(self, pid, label):
        figures = {"pid": pid, "label": label, "virtual_bytes": 8 << 20, "mapped_bytes": 1 << 20,
                   "limit_bytes": None}
        with open(os.path.join(self.dir, f"{pid}-{label}.json"), "w") as f:
            json.dump(figures, f)
        return figures

    def test_live_engines_are_listed_and_dead_ones_removed(self):
        live = self.publish(os.getpid(), "3")
        dead_pid = 2**22 + 12345  # above pid_max's default: no such process
        self.publish(dead_pid, "0")
        open(os.path.join(self.dir, f"{dead_pid}-0.limit"), "w").close()
        self.assertEqual(control.engines(self.dir), {f"{os.getpid()}-3": live})
        self.assertEqual(os.listdir(self.dir), [f"{os.getpid()}-3.json"])

    def test_a_limit_is_written_for_a_live_engine_and_read_back_once(self):
        self.publish(os.getpid(), "1")
        self.assertEqual(control.main(["--dir", self.dir, "limit", f"{os.getpid()}-1", "2MiB"]), 0)
        # the engine's side of the same files
        end = control.Endpoint(self.dir, "1")
        self.assertEqual(end.read_limit(), (True, 2 << 20))
        self.assertEqual(end.read_limit(), (False, None))  # unchanged: nothing to apply
        os.unlink(end.limit_path)
        self.assertEqual(end.read_limit(), (True, None))  # removed: no limit

    def test_unknown_engines_and_bad_sizes_are_refused_with_status_2(self):
        self.publish(os.getpid(), "1")
        self.assertEqual(control.main(["--dir", self.dir, "limit", "1-99", "1MiB"]), 2)
        self.assertEqual(control.main(["--dir", self.dir, "limit", f"{os.getpid()}-1", "x"]), 2)
        self.assertFalse(any(f.endswith(".limit") for f in os.listdir(self.dir)))


if __name__ == "__main__":
    unittest.main()
