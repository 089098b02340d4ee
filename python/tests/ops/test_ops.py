"""`strata ps`, `top`, `limit` and `metrics` over real processes (.ci/run): two C programs and
one Python program with torch, all on the host backend at once, each with allocations under
two tags (one asleep) and one KV space, publishing into a folder of this test's own
(STRATA_SHM_DIR), so concurrent runs and other strata processes of this user never meet.

Needs: STRATA_BIN (the `strata` CLI), STRATA_LIB (libstrata.so), a C compiler ($CC or cc),
torch, and prometheus_client (its OpenMetrics parser reads `strata metrics`).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from prometheus_client.openmetrics.parser import text_string_to_metric_families

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
MIB = 1 << 20
# (weights MiB, cache MiB, KV tokens): the cache tag sleeps with a host copy; 2 KiB per token.
C_A, C_B, PY = (3, 1, 1500), (6, 2, 3000), (5, 2, 700)


class Worker:
    def __init__(self, argv, env):
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            self.stop()
            raise RuntimeError(f"{argv} did not start: {line}")
        self.allocated, self.reserved, self.pool_in_use = (int(x) for x in line[1:4])
        self.pid = self.proc.pid

    def alloc(self, nbytes):
        self.proc.stdin.write(f"alloc {nbytes}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class OpsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.strata = os.environ["STRATA_BIN"]
        lib = os.path.abspath(os.environ["STRATA_LIB"])
        cls.tmp = tempfile.mkdtemp(prefix="strata-ops-test-")
        cls.shm = os.path.join(cls.tmp, "shm")
        os.mkdir(cls.shm, 0o700)
        cc = os.environ.get("CC", "cc")
        worker = os.path.join(cls.tmp, "ops_worker")
        lib_dir = os.path.dirname(lib)
        subprocess.run(
            [cc, "-std=c11", "-Wall", "-Werror", "-I", os.path.join(ROOT, "include"),
             os.path.join(HERE, "ops_worker.c"), "-o", worker, "-L", lib_dir, "-lstrata",
             f"-Wl,-rpath,{lib_dir}"],
            check=True,
        )
        cls.env = dict(os.environ, STRATA_SHM_DIR=cls.shm, STRATA_BACKEND="host", STRATA_LIB=lib)
        cls.env.pop("STRATA_HOST_STRICT", None)  # torch writes the KV tensor through DLPack
        cls.env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + cls.env.get("PYTHONPATH", "")
        cls.started = []
        try:
            cls.a = cls.start([worker, *map(str, C_A)])
            cls.b = cls.start([worker, *map(str, C_B)])
            cls.py = cls.start([sys.executable, os.path.join(HERE, "ops_worker.py"), *map(str, PY)])
        except Exception:
            cls.tearDownClass()
            raise
        # pid: (worker, sizes, awake tag, asleep tag, MiB offloaded to host memory)
        cls.workers = {cls.a.pid: (cls.a, C_A, "weights", "cache", 2),
                       cls.b.pid: (cls.b, C_B, "weights", "cache", 2),
                       cls.py.pid: (cls.py, PY, "params", "scratch", 0)}

    @classmethod
    def start(cls, argv):
        w = Worker(argv, cls.env)
        cls.started.append(w)
        return w

    @classmethod
    def tearDownClass(cls):
        for w in cls.started:
            w.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def cli(self, *args, env=None):
        return subprocess.run([self.strata, *args], env=env or self.env, capture_output=True, text=True)

    def ps(self):
        out = self.cli("ps", "--json")
        self.assertEqual(out.returncode, 0, out.stderr)
        return json.loads(out.stdout)

    def rows_of(self, pids, deadline_s=30, exact=True):
        """`strata ps --json` once every pid in `pids` shows the figures it had when it said
        ready (published every 250 ms: a file written before then, mid-sleep, is older), by pid.
        """
        end = time.monotonic() + deadline_s

        def current(r, w):
            return (r["allocated_bytes"], r["reserved_bytes"], r["pool_in_use_bytes"]) == (
                w.allocated, w.reserved, w.pool_in_use)

        while True:
            rows = {r["pid"]: r for r in self.ps() if r["device"] is not None}
            ready = all(p in rows and (not exact or current(rows[p], self.workers[p][0])) for p in pids)
            if ready or time.monotonic() > end:
                return rows
            time.sleep(0.1)

    def test_1_ps_shows_every_process_with_its_bytes_tags_and_kv(self):
        rows = self.rows_of(self.workers)
        for pid, (w, (weights, cache, tokens), awake, asleep, moved) in self.workers.items():
            r = rows[pid]
            self.assertEqual(r["library"], "strata")
            self.assertEqual(r["allocated_bytes"], w.allocated)
            self.assertEqual(r["allocated_bytes"], (weights + cache + moved) * MIB)
            self.assertEqual(r["reserved_bytes"], w.reserved)
            self.assertEqual(r["pool_in_use_bytes"], w.pool_in_use)
            self.assertGreaterEqual(r["peak_bytes"], r["allocated_bytes"])
            self.assertIsNone(r["limit_bytes"])
            tags = {t["name"]: t for t in r["tags"]}
            self.assertEqual(set(tags), {awake, asleep} | ({"moved"} if moved else set()))
            self.assertEqual(tags[awake]["state"], "awake")
            self.assertEqual(tags[awake]["allocated_bytes"], weights * MIB)
            self.assertGreaterEqual(tags[awake]["tiers"]["device"], weights * MIB)
            self.assertEqual(tags[awake]["tiers"]["host"], 0)
            self.assertEqual(tags[asleep]["state"], "asleep")
            self.assertEqual(tags[asleep]["tiers"], {"device": 0, "peer": 0, "host": cache * MIB, "disk": 0})
            self.assertEqual(tags[asleep]["bytes"], cache * MIB)
            if moved:
                self.assertEqual(tags["moved"]["state"], "offloaded")
                self.assertEqual(tags["moved"]["tiers"], {"device": 0, "peer": 0, "host": moved * MIB, "disk": 0})
                self.assertGreaterEqual(r["moved_bytes"], moved * MIB)
            (space,) = r["kv_spaces"]
            self.assertEqual((space["tokens"], space["requests"]), (tokens, 1))
            # 2 KiB per token: 1024 tokens per 2 MiB page, K and V of one layer per block.
            blocks = -(-tokens // 1024)
            self.assertEqual(space["bytes"]["device"], blocks * 2 * 2 * MIB)
            # The device's tiers: the allocator's pages (the offloaded ones on the host), the
            # sleeping copy, the KV blocks.
            self.assertEqual(r["tiers"]["host"], (cache + moved) * MIB)
            self.assertEqual(r["tiers"]["device"], w.reserved - moved * MIB + space["bytes"]["device"])

    def test_2_limit_caps_one_process_and_none_lifts_it(self):
        self.rows_of([self.a.pid])
        cap = self.a.pool_in_use + 4 * MIB
        started = time.monotonic()
        out = self.cli("limit", f"{self.a.pid}:0", f"{cap // MIB}MiB")
        took = time.monotonic() - started
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(f"limit {cap // MIB}.0 MiB", out.stdout)
        print(f"strata limit applied and confirmed in {took:.2f} s", file=sys.stderr)
        self.assertEqual(self.ps_row(self.a.pid)["limit_bytes"], cap)
        self.assertTrue(self.a.alloc(8 * MIB).startswith("fail"), "beyond the limit")
        self.assertEqual(self.a.alloc(2 * MIB), "ok", "under the limit")
        # The others are not capped.
        self.assertIsNone(self.ps_row(self.b.pid)["limit_bytes"])
        self.assertEqual(self.b.alloc(8 * MIB), "ok")
        # A fraction, as strata_set_memory_fraction: half the device.
        out = self.cli("limit", str(self.a.pid), "0.5")
        self.assertEqual(out.returncode, 0, out.stderr)
        row = self.ps_row(self.a.pid)
        self.assertEqual(row["limit_bytes"], row["total_bytes"] // 2)
        self.assertEqual(self.cli("limit", str(self.a.pid), "none").returncode, 0)
        self.assertIsNone(self.ps_row(self.a.pid)["limit_bytes"])
        self.assertEqual(self.a.alloc(8 * MIB), "ok")

    def ps_row(self, pid):
        (row,) = [r for r in self.ps() if r["pid"] == pid]
        return row

    def test_3_top_once_renders_them(self):
        self.rows_of(self.workers)
        svg = os.path.join(self.tmp, "top.svg")
        out = self.cli("top", "--once", "--svg", svg)
        self.assertEqual(out.returncode, 0, out.stderr)
        for pid in self.workers:
            self.assertIn(str(pid), out.stdout)
        for name in ("weights", "cache", "moved", "params", "scratch", "asleep", "awake", "offloaded", "space"):
            self.assertIn(name, out.stdout)
        with open(svg) as f:
            image = f.read()
        self.assertTrue(image.startswith("<svg") and str(self.py.pid) in image)

    def test_4_metrics_parse_as_openmetrics(self):
        rows = self.rows_of(self.workers)
        out = self.cli("metrics")
        self.assertEqual(out.returncode, 0, out.stderr)
        families = {f.name: f for f in text_string_to_metric_families(out.stdout)}
        reserved = {int(s.labels["pid"]): s.value for s in families["strata_reserved_bytes"].samples}
        for pid in self.workers:
            self.assertEqual(reserved[pid], rows[pid]["reserved_bytes"])
        asleep = [s for s in families["strata_tag_bytes"].samples
                  if s.labels["state"] == "asleep" and s.labels["tier"] == "host"]
        self.assertEqual({int(s.labels["pid"]) for s in asleep}, set(self.workers))
        tokens = {int(s.labels["pid"]): s.value for s in families["strata_kv_tokens"].samples}
        self.assertEqual(tokens, {pid: w[1][2] for pid, w in self.workers.items()})
        self.assertEqual(families["strata_allocations"].type, "counter")

    def test_5_bad_input_exits_2_and_odd_files_are_skipped(self):
        # Above the kernel's largest pid_max (2^22).
        out = self.cli("limit", str((1 << 22) + 1), "1GiB")
        self.assertEqual(out.returncode, 2)
        self.assertIn("no strata process", out.stderr)
        for bad in ("12parsecs", "1.5", "-1", ""):
            out = self.cli("limit", str(self.a.pid), bad)
            self.assertEqual(out.returncode, 2, bad)
            self.assertIn("bad size", out.stderr)
        self.assertEqual(self.cli("limit", "x:y", "1GiB").returncode, 2)
        self.assertEqual(self.cli("limit", f"{self.a.pid}:7", "1GiB").returncode, 2)
        # Malformed and foreign-version files of a live pid (this one): skipped with a warning.
        me = os.getpid()
        odd = {f"{me}.broken.json": "{not json", f"{me}.future.json": json.dumps({"version": 99})}
        for name, text in odd.items():
            with open(os.path.join(self.shm, name), "w") as f:
                f.write(text)
        out = self.cli("ps", "--json")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("malformed", out.stderr)
        self.assertIn("layout version 99", out.stderr)
        self.assertNotIn(me, [r["pid"] for r in json.loads(out.stdout)])
        for name in odd:
            os.remove(os.path.join(self.shm, name))
        # A folder others may write to is refused.
        loose = os.path.join(self.tmp, "loose")
        os.mkdir(loose)
        os.chmod(loose, 0o777)
        out = self.cli("ps", env=dict(self.env, STRATA_SHM_DIR=loose))
        self.assertEqual(out.returncode, 1)
        self.assertIn("writable by others", out.stderr)

    @unittest.skipUnless(os.geteuid() == 0, "giving a file to another uid needs root")
    def test_6_another_users_file_is_never_read_or_removed(self):
        path = os.path.join(self.shm, f"{os.getpid()}.strata.json")
        with open(path, "w") as f:
            f.write("{}")
        os.chown(path, 65534, 65534)
        out = self.cli("ps", "--json")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("belongs to uid 65534", out.stderr)
        self.assertTrue(os.path.exists(path))
        os.remove(path)

    def test_7_a_killed_process_leaves_the_listing(self):
        self.rows_of([self.b.pid], exact=False)
        name = f"{self.b.pid}.strata.json"
        self.assertIn(name, os.listdir(self.shm))
        os.kill(self.b.pid, signal.SIGKILL)
        self.b.proc.wait()
        pids = [r["pid"] for r in self.ps()]
        self.assertNotIn(self.b.pid, pids)
        self.assertIn(self.a.pid, pids)
        self.assertNotIn(name, os.listdir(self.shm), "the dead process's file is pruned")
        out = self.cli("limit", str(self.b.pid), "1GiB")
        self.assertEqual(out.returncode, 2)

    def test_8_a_process_exiting_normally_removes_its_file(self):
        self.rows_of([self.a.pid], exact=False)
        name = f"{self.a.pid}.strata.json"
        self.assertIn(name, os.listdir(self.shm))
        self.a.proc.stdin.write("quit\n")
        self.a.proc.stdin.flush()
        self.assertEqual(self.a.proc.wait(timeout=30), 0)
        self.assertNotIn(name, os.listdir(self.shm), "removed at exit, before any reader")


if __name__ == "__main__":
    unittest.main()
