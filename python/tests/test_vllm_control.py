"""strata.vllm.control (KV limits from outside an engine) without vLLM: sizes, the folder's
listing of live and dead engines, and the CLI's refusals. The engine side runs in
python/tests/vllm/test_vllm.py."""

import json
import os
import stat
import subprocess
import sys
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



def cli(directory, *args, timeout=60):
    """The control CLI in a process of its own: a hang fails the test instead of the runner."""
    return subprocess.run(
        [sys.executable, "-m", "strata.vllm.control", "--dir", directory, *args],
        capture_output=True, text=True, timeout=timeout,
    )


class HostileFolder(unittest.TestCase):
    """Files an engine did not write, planted links and FIFOs, and folders others can write."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        self.me = os.getpid()

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.dir, name)

    def publish(self, label="1"):
        figures = {"pid": self.me, "label": label, "virtual_bytes": 8 << 20, "mapped_bytes": 1 << 20,
                   "limit_bytes": None}
        with open(self.path(f"{self.me}-{label}.json"), "w") as f:
            json.dump(figures, f)

    def test_malformed_engine_files_are_skipped_by_list_and_refused_by_limit(self):
        self.publish("ok")
        bad = {
            "list": "[1, 2]", "null": "null", "string": '"x"', "strpid": '{"pid": "1"}',
            "infpid": '{"pid": Infinity}', "boolpid": '{"pid": true, "label": "b", "virtual_bytes": 0, '
            '"mapped_bytes": 0, "limit_bytes": null}', "fields": f'{{"pid": {self.me}}}',
            "nopid": '{"label": "x", "virtual_bytes": 0, "mapped_bytes": 0, "limit_bytes": null}',
            "neg": '{"pid": -1, "label": "n", "virtual_bytes": 0, "mapped_bytes": 0, "limit_bytes": null}',
            "other": '{"pid": 1, "label": "o", "virtual_bytes": 0, "mapped_bytes": 0, "limit_bytes": null}',
            "nan": f'{{"pid": {self.me}, "label": "n", "virtual_bytes": NaN, "mapped_bytes": 0, "limit_bytes": null}}',
        }
        for label, text in bad.items():
            with open(self.path(f"{self.me}-{label}.json"), "w") as f:
                f.write(text)
        listed = cli(self.dir, "list", "--json")
        self.assertNotIn("Traceback", listed.stderr)
        self.assertEqual((listed.returncode, listed.stderr.count("skipped")), (0, len(bad)), listed.stderr)
        # Without a pid (once pid -1: os.kill(-1, 0) succeeds) or with another's, not live.
        self.assertEqual(list(json.loads(listed.stdout)), [f"{self.me}-ok"])
        warnings = []
        found = control.engines(self.dir, on_skip=lambda name, why: warnings.append(name))
        self.assertEqual(list(found), [f"{self.me}-ok"])
        self.assertEqual(sorted(warnings), sorted(f"{self.me}-{label}" for label in bad))
        for label in bad:
            p = cli(self.dir, "limit", f"{self.me}-{label}", "1MiB")
            self.assertEqual(p.returncode, 2, (label, p.stderr))
            self.assertNotIn("Traceback", p.stderr)
        self.assertEqual(len(os.listdir(self.dir)), len(bad) + 1)  # nothing written, nothing removed

    def test_a_file_without_a_pid_is_no_live_engine(self):
        # Once read as pid -1, and os.kill(-1, 0) succeeds: listed as live, limits accepted.
        with open(self.path("77-1.json"), "w") as f:
            json.dump({"label": "1", "virtual_bytes": 0, "mapped_bytes": 0, "limit_bytes": None}, f)
        self.assertEqual(control.main(["--dir", self.dir, "list", "--json"]), 0)
        self.assertEqual(control.engines(self.dir), {})
        self.assertEqual(control.main(["--dir", self.dir, "limit", "77-1", "1MiB"]), 2)
        self.assertEqual(os.listdir(self.dir), ["77-1.json"])

    def test_a_limit_path_that_is_a_directory_is_refused_and_leaves_nothing(self):
        self.publish()
        os.mkdir(self.path(f"{self.me}-1.limit"))
        p = cli(self.dir, "limit", f"{self.me}-1", "1MiB")
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertNotIn("Traceback", p.stderr)
        self.assertEqual(sorted(os.listdir(self.dir)), [f"{self.me}-1.json", f"{self.me}-1.limit"])

    def test_planted_links_are_never_followed(self):
        self.publish()
        outside = tempfile.TemporaryDirectory()
        self.addCleanup(outside.cleanup)
        victim = os.path.join(outside.name, "victim")
        with open(victim, "w") as f:
            f.write("precious\n")
        # The temp name the writer used to open (`P-L.limit.<its pid>.tmp`, this process's).
        name = f"{self.me}-1.limit"
        os.symlink(victim, self.path(f"{name}.{self.me}.tmp"))
        self.assertEqual(control.main(["--dir", self.dir, "limit", f"{self.me}-1", "2MiB"]), 0)
        p = cli(self.dir, "limit", f"{self.me}-1", "3MiB")
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(victim) as f:
            self.assertEqual(f.read(), "precious\n")
        self.assertTrue(stat.S_ISREG(os.lstat(self.path(name)).st_mode))
        with open(self.path(name)) as f:
            self.assertEqual(f.read(), "3MiB\n")
        # The engine's side: a limit file that is a link is not followed (nor applied).
        os.unlink(self.path(name))
        os.symlink(victim, self.path(name))
        end = control.Endpoint(self.dir, "1")
        with self.assertRaises(control.ControlError):
            end.read_limit()
        self.assertEqual(end.read_limit(), (False, None))  # reported once, not every poll
        # ... and its figures are not written through a planted temp name either.
        os.symlink(victim, self.path(f"{self.me}-1.json.{self.me}.tmp"))
        end.publish({"pid": self.me})
        with open(victim) as f:
            self.assertEqual(f.read(), "precious\n")
        end.remove()

    def test_fifos_hang_neither_list_nor_limit_nor_the_engine(self):
        self.publish("ok")
        os.mkfifo(self.path(f"{self.me}-1.json"))
        listed = cli(self.dir, "list", timeout=30)
        self.assertEqual(listed.returncode, 0, listed.stderr)
        self.assertIn(f"{self.me}-1", listed.stderr)  # skipped, with a warning
        self.assertEqual(cli(self.dir, "limit", f"{self.me}-1", "1MiB", timeout=30).returncode, 2)
        engine = subprocess.run(
            [sys.executable, "-c", "import os, sys; from strata.vllm import control\n"
             "end = control.Endpoint(sys.argv[1], 'ok')\n"
             "os.mkfifo(end.limit_path)\n"
             "try:\n    end.read_limit()\nexcept control.ControlError as e:\n    print('refused', e)\n",
             self.dir],
            capture_output=True, text=True, timeout=30,
        )
        self.assertIn("refused", engine.stdout, engine.stderr)

    def test_the_folder_is_private_and_refused_when_others_can_write_it(self):
        fresh = os.path.join(self.dir, "made")
        end = control.Endpoint(fresh, "1")
        self.assertEqual(stat.S_IMODE(os.stat(fresh).st_mode), 0o700)
        end.remove()
        shared = os.path.join(self.dir, "shared")
        os.mkdir(shared)
        os.chmod(shared, 0o777)
        with self.assertRaisesRegex(control.ControlError, "writable"):
            control.Endpoint(shared, "1")
        self.assertEqual(cli(shared, "list").returncode, 2)
        if os.geteuid() == 0:
            theirs = os.path.join(self.dir, "theirs")
            os.mkdir(theirs, 0o700)
            os.chown(theirs, 65534, 65534)
            with self.assertRaisesRegex(control.ControlError, "owned by uid 65534"):
                control.Endpoint(theirs, "1")
            p = cli(theirs, "limit", "1-1", "1MiB")
            self.assertEqual(p.returncode, 2)
            self.assertIn("owned by uid 65534", p.stderr)
        link = os.path.join(self.dir, "link")
        os.symlink(fresh, link)
        with self.assertRaisesRegex(control.ControlError, "not a directory"):
            control.Endpoint(link, "1")


if __name__ == "__main__":
    unittest.main()
