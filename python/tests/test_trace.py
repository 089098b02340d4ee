"""Tests of strata.trace's conversion from profiler memory events to the replay CSV (no torch
needed: recording itself runs the profiler, see benches/traces/llama_workload.py)."""

import gzip
import json
import os
import tempfile
import unittest

from strata import trace


class TraceTest(unittest.TestCase):
    def test_chrome_memory_events_become_csv_with_fresh_ids(self):
        chrome = {"traceEvents": [
            {"name": "aten::empty", "ts": 1, "args": {}},
            {"name": "[memory]", "ts": 5, "args": {"Addr": 64, "Bytes": 4096, "Device Type": 1}},
            {"name": "[memory]", "ts": 2, "args": {"Addr": 8, "Bytes": -16, "Device Type": 1}},
            {"name": "[memory]", "ts": 6, "args": {"Addr": 64, "Bytes": -4096, "Device Type": 1}},
            {"name": "[memory]", "ts": 7, "args": {"Addr": 64, "Bytes": 100, "Device Type": 1}},
            {"name": "[memory]", "ts": 8, "args": {"Addr": 9, "Bytes": 3, "Device Type": 0}},
        ]}
        events = trace.memory_events(chrome)
        self.assertEqual([e[0] for e in events], [8, 64, 64, 64, 9])  # time order
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t.csv.gz")
            self.assertEqual(trace.write_csv(events, path), (2, 1))
            with gzip.open(path, "rt") as f:
                lines = f.read().splitlines()
            # The free of address 8 predates the recording; address 64 is reused under a new id;
            # the CPU event is of another device type than the busiest.
            self.assertEqual(lines, ["op,id,bytes", "alloc,0,4096", "free,0,4096", "alloc,1,100"])
            raw = os.path.join(tmp, "t.json")
            with open(raw, "w") as f:
                json.dump(chrome, f)
            out = os.path.join(tmp, "u.csv")
            self.assertEqual(trace.main(["convert", raw, "-o", out]), 0)
            with open(out) as f:
                self.assertEqual(f.read().splitlines(), lines)


if __name__ == "__main__":
    unittest.main()
