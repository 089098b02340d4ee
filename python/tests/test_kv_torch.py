"""strata.kv with PyTorch: KV tensors are framework tensors without a copy (DLPack). On the host
backend outside strict mode they are CPU tensors over the space's own pages; on CUDA, CUDA
tensors. ffi/tests/python.rs runs this module a second time with STRATA_HOST_STRICT=0 and checks
that these tests ran (they skip in strict mode, where device memory is not CPU-accessible), on a
GPU too."""

import tempfile
import unittest

try:
    import torch
except ImportError:  # the tests skip themselves
    torch = None

import strata
from kv_device import NO_DEVICE, second_device, torch_device
from strata import kv

LAYERS, HEADS, DIM = 2, 4, 64  # float16: 512 bytes per token, 4096 tokens per 2 MiB page


@unittest.skipUnless(torch_device(), NO_DEVICE)
class KvTorchTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.space = kv.KvSpace(
            layers=LAYERS,
            kv_heads=HEADS,
            head_dim=DIM,
            dtype="float16",
            max_requests=4,
            max_tokens=8192,
            host_bytes=64 << 20,
            disk_bytes=64 << 20,
            disk_dir=self.dir.name,
        )
        self.device = torch_device()

    def tearDown(self):
        self.space.close()
        self.dir.cleanup()

    def tensors(self):
        return {(l, k): torch.from_dlpack(self.space.tensor(l, k)) for l in range(LAYERS) for k in "kv"}

    def test_tensors_are_the_space_memory_with_its_shape(self):
        t = self.tensors()
        k0 = t[0, "k"]
        self.assertEqual(k0.device.type, self.device)
        self.assertEqual(k0.dtype, torch.float16)
        self.assertEqual(tuple(k0.shape), (4, 8192, HEADS, DIM))
        self.assertEqual(k0.data_ptr(), self.space.tensor(0, "k").data_ptr)
        self.assertEqual(k0.stride()[1:], (HEADS * DIM, DIM, 1))
        r = self.space.admit()
        r.append(100)
        rows = torch.from_dlpack(r.tensor(1, "v"))
        self.assertEqual(tuple(rows.shape), (8192, HEADS, DIM))
        self.assertEqual(rows.data_ptr(), t[1, "v"][r.slot].data_ptr())
        # Written through torch, read back through strata's backend copy, and the other way.
        rows[:100] = torch.arange(100 * HEADS * DIM, dtype=torch.float16).reshape(100, HEADS, DIM)
        self.assertEqual(r.read(1, "v", 0, 100), rows[:100].cpu().numpy().tobytes())
        r.write(0, "k", 0, bytes(range(256)) * 200)
        self.assertEqual(t[0, "k"][r.slot, :100].cpu().numpy().tobytes(), bytes(range(256)) * 200)

    def test_spill_to_host_and_disk_and_back_bit_for_bit_at_the_same_address(self):
        t = self.tensors()
        ptrs = {key: x.data_ptr() for key, x in t.items()}
        reqs = [self.space.admit() for _ in range(3)]
        for i, r in enumerate(reqs):
            r.append(3000 + 2000 * i)
        g = torch.Generator().manual_seed(7)
        want = {}
        for r in reqs:
            n = r.tokens
            for key, x in t.items():
                x[r.slot, :n] = torch.randn(n, HEADS, DIM, generator=g).to(x.dtype).to(x.device)
                want[r.handle, key] = x[r.slot, :n].clone()
        for tier in ("host", "disk"):
            for r in reqs:
                r.spill(tier)
                self.assertEqual(set(r.residency()), {tier})
            # Spilled: the pages went back; the addresses now read the shared zero page.
            self.assertEqual(int(t[0, "k"][reqs[0].slot, :100].abs().sum().item()), 0)
            stream = torch.cuda.current_stream() if self.device == "cuda" else None
            self.space.make_resident(reqs, stream)
            if stream is not None:
                stream.synchronize()
            for r in reqs:
                self.assertEqual(set(r.residency()), {"device"})
                for key, x in t.items():
                    got = x[r.slot, : r.tokens]
                    self.assertTrue(torch.equal(got.view(torch.int16), want[r.handle, key].view(torch.int16)))
            self.assertEqual({key: x.data_ptr() for key, x in t.items()}, ptrs)
        st = self.space.stats()
        self.assertGreater(st["bytes_to_device"], 0)
        self.assertGreater(st["disk_read_bytes"], 0)

    def test_lost_blocks_called_back_once_each_then_recomputed_in_place(self):
        t = self.tensors()
        reqs = [self.space.admit() for _ in range(2)]
        for r in reqs:
            r.append(5000)  # 2 blocks each
            t[1, "k"][r.slot, :5000] = 1.0
        seen = []
        self.space.on_lost(lambda request, block: seen.append((request.handle, block)))
        with self.assertRaises(strata.OutOfMemory):
            self.space.revoke(1 << 20)
        self.assertEqual(sorted(seen), sorted((r.handle, b) for r in reqs for b in range(2)))
        self.space.make_resident(reqs)
        for r in reqs:
            t[1, "k"][r.slot, :5000] = 2.0  # the engine recomputes into the same tensor
            self.assertEqual(r.read(1, "k", 4999, 1), t[1, "k"][r.slot, 4999].cpu().numpy().tobytes())
        self.assertEqual(self.space.stats()["lost_blocks"], 4)

    def test_close_is_refused_while_tensors_are_alive(self):
        x = torch.from_dlpack(self.space.tensor(0, "v"))
        with self.assertRaises(strata.InvalidState):
            self.space.close()
        del x
        self.space.close()
        with self.assertRaises(strata.StaleHandle):
            self.space.admit()

    def test_close_when_released_waits_for_the_last_tensor(self):
        x = torch.from_dlpack(self.space.tensor(0, "v"))
        y = torch.from_dlpack(self.space.tensor(1, "k"))
        self.space.close_when_released()
        self.space.admit()  # still open: tensors of it are alive
        del x
        self.assertIsNotNone(self.space.handle)
        del y
        self.assertIsNone(self.space.handle)
        with self.assertRaises(strata.StaleHandle):
            self.space.admit()


if __name__ == "__main__":
    unittest.main()


class _Allocation:
    """Owner of a `strata_malloc` block exported through DLPack (freed by the test)."""

    def _dlpack_released(self):
        pass


def float32_tensor(ptr, n):
    """A torch tensor of `n` float32 over strata memory at `ptr` on device 0 (CPU or CUDA)."""
    from strata import _dlpack

    kind = _dlpack.CUDA if torch_device() == "cuda" else _dlpack.CPU
    return torch.from_dlpack(_dlpack.capsule(_Allocation(), ptr, kind, 0, _dlpack.dtype_of("float32", 4), [n], [1]))


def synchronize():
    """torch's queued work done before strata moves pages under it (CUDA; a no-op on the CPU)."""
    if torch_device() == "cuda":
        torch.cuda.synchronize()


@unittest.skipUnless(torch_device(), NO_DEVICE)
class AllocatorOffloadTorchTest(unittest.TestCase):
    """A tensor over a `strata_malloc` block (a CPU tensor through DLPack outside strict mode, a
    CUDA tensor on a GPU) keeps its address and bytes while strata moves its pages."""

    def test_tensor_keeps_its_data_ptr_and_bytes_across_offload_and_onload(self):
        from strata import _lib

        n = (3 << 20) // 4
        with strata.tag("torch-offload"):
            ptr = _lib.malloc(n * 4)
        try:
            t = float32_tensor(ptr, n)
            t.copy_(torch.arange(n, dtype=torch.float32))
            expected = t.clone()
            synchronize()
            strata.offload("torch-offload", tier="host")
            self.assertGreater(strata.spill_stats("torch-offload")["host_bytes"], 0)
            self.assertEqual(t.data_ptr(), ptr)
            self.assertTrue(torch.equal(t, expected), "bit-identical while offloaded")
            t[:16] = -1.0  # usable while offloaded
            expected[:16] = -1.0
            synchronize()
            strata.onload("torch-offload")
            synchronize()
            self.assertEqual(strata.spill_stats("torch-offload")["host_bytes"], 0)
            self.assertEqual(t.data_ptr(), ptr)
            self.assertTrue(torch.equal(t, expected), "bit-identical after onload")
            del t
        finally:
            _lib.free(ptr)

    @unittest.skipIf(second_device(), second_device())
    def test_tensor_keeps_its_data_ptr_and_bytes_when_a_lender_takes_its_pages_back(self):
        """A tag overflows onto device 1's pages while device 0 is full (under a cap of 16 MiB
        over what it holds, so that "full" is the same on any device); device 1 revokes them.
        The tensor's pages move to device 0 at the same address, bytes unchanged, and the move
        is noticed exactly once."""
        from strata import _lib

        strata.empty_cache()
        s = strata.stats(0)
        held = s["pool_in_use_bytes"] + s["pool_free_bytes"]
        strata.set_memory_fraction((held + (16 << 20)) / s["total_bytes"], 0)
        self.addCleanup(strata.set_memory_fraction, 1.0, 0)
        hog = []
        with strata.tag("torch-hog"):
            while True:
                try:
                    hog.append(_lib.malloc(2 << 20))
                except strata.OutOfMemory:
                    break
        n = (4 << 20) // 4
        ptr = None
        try:
            with strata.tag("torch-lent"):  # a tag exists while pushed or holding memory
                strata.set_overflow_peer("torch-lent", 1)
                ptr = _lib.malloc(n * 4)
            self.assertGreaterEqual(strata.spill_stats("torch-lent")["peer_bytes"], n * 4)
            t = float32_tensor(ptr, n)
            t.copy_(torch.arange(n, dtype=torch.float32))
            expected = t.clone()
            synchronize()
            for p in hog:
                _lib.free(p)
            hog = []
            strata.empty_cache()
            moved = strata.revoke_peer(1)
            synchronize()
            self.assertEqual(len(moved), 1, moved)
            self.assertEqual((moved[0]["device"], moved[0]["lender"]), (0, 1))
            self.assertTrue(moved[0]["to_device"], "device 0 had room again")
            self.assertLessEqual(moved[0]["ptr"], ptr)
            self.assertGreaterEqual(moved[0]["ptr"] + moved[0]["bytes"], ptr + n * 4)
            self.assertEqual(strata.take_revoked(), [], "each notice is handed out once")
            stats = strata.spill_stats("torch-lent")
            self.assertEqual((stats["peer_bytes"], stats["host_bytes"]), (0, 0))
            self.assertEqual(t.data_ptr(), ptr)
            self.assertTrue(torch.equal(t, expected), "bit-identical after the revocation")
            del t
        finally:
            for p in hog:
                _lib.free(p)
            if ptr is not None:
                strata.set_overflow("torch-lent", None)
                _lib.free(ptr)
