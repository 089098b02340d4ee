"""Property test (hypothesis) of strata.kv's integer arguments: sequences of append, truncate,
write, read, tensor and advance with integers around 2**31, 2**32, 2**63, 2**64 and negative
ones, beside small valid ones. Each call either does what a model of the request predicts or
raises strata.InvalidArgument and changes nothing; after every step the request's bytes are the
model's (nothing lost, nothing overwritten). Derandomized and bounded (a fixed number of
examples and steps), so a run takes seconds and is the same every time. Skips without
hypothesis (python/requirements-ci.txt installs it; ffi/tests/python.rs checks it ran there)."""

import unittest

import strata
from strata import kv

try:
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
except ImportError:  # the tests skip themselves
    settings = None

LAYERS, MAX_TOKENS, BPT = 2, 4096, 8  # uint8, one head of 8: 8 bytes per token
EDGES = sorted({sign * base + d for base in (2**31, 2**32, 2**63, 2**64) for sign in (1, -1) for d in (-1, 0, 1)}
               | {-1, 0, 1})
U64 = 2**64


def pattern(seed, n):
    return bytes((seed * 97 + i * 13) % 251 for i in range(n))


if settings is not None:
    # Integers at the C types' limits and beyond, any 66-bit integer, and small valid ones.
    ints = st.sampled_from(EDGES) | st.integers(-(2**65), 2**65) | st.integers(0, 64)

    class KvRequestMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.space = kv.KvSpace(layers=LAYERS, kv_heads=1, head_dim=8, dtype="uint8",
                                    max_requests=2, max_tokens=MAX_TOKENS)
            self.r = self.space.admit()
            self.data = [bytearray() for _ in range(LAYERS)]  # the model: each layer's K bytes
            self.seed = 0

        def teardown(self):
            self.space.close()

        def refused(self, fn, *args):
            """`fn(*args)` must raise InvalidArgument (a typed error, nothing changed)."""
            try:
                fn(*args)
            except strata.InvalidArgument:
                return
            raise AssertionError(f"{fn.__name__}{args} was accepted")

        @property
        def tokens(self):
            return len(self.data[0]) // BPT

        def fill(self, first, count):
            for layer in range(LAYERS):
                self.seed += 1
                data = pattern(self.seed, count * BPT)
                self.r.write(layer, "k", first, data)
                self.data[layer][first * BPT:(first + count) * BPT] = data

        @rule(tokens=ints)
        def append(self, tokens):
            before = self.tokens
            if 0 < tokens <= MAX_TOKENS - before:
                self.r.append(tokens)
                for layer in range(LAYERS):
                    self.data[layer].extend(bytes(tokens * BPT))
                self.fill(before, tokens)
            else:
                self.refused(self.r.append, tokens)

        @rule(tokens=ints)
        def truncate(self, tokens):
            if 0 <= tokens <= self.tokens:
                self.r.truncate(tokens)
                for d in self.data:
                    del d[tokens * BPT:]
            else:
                self.refused(self.r.truncate, tokens)

        @rule(layer=ints, first=ints, count=st.integers(1, 8))
        def write(self, layer, first, count):
            data = pattern(self.seed + 1000, count * BPT)
            if 0 <= layer < LAYERS and 0 <= first and first + count <= self.tokens:
                self.r.write(layer, "k", first, data)
                self.data[layer][first * BPT:(first + count) * BPT] = data
            else:
                self.refused(self.r.write, layer, "k", first, data)

        @rule(layer=ints, first=ints, count=ints)
        def read(self, layer, first, count):
            if 0 <= layer < LAYERS and 0 <= first and 0 < count and first + count <= self.tokens:
                want = bytes(self.data[layer][first * BPT:(first + count) * BPT])
                assert self.r.read(layer, "k", first, count) == want
            else:
                self.refused(self.r.read, layer, "k", first, count)

        @rule(layer=ints)
        def tensor(self, layer):
            if 0 <= layer < LAYERS:
                t = self.space.tensor(layer, "k")
                assert t.shape == (2, MAX_TOKENS, 1, 8)
            else:
                self.refused(self.space.tensor, layer, "k")

        @rule(step=ints)
        def advance(self, step):
            if 0 <= step < U64:
                self.space.advance(step)  # any step: the clock never goes back, no error
            else:
                self.refused(self.space.advance, step)

        @invariant()
        def nothing_lost(self):
            assert self.r.tokens == self.tokens
            if self.tokens:
                for layer in range(LAYERS):
                    assert self.r.read(layer, "k", 0, self.tokens) == bytes(self.data[layer])

    KvRequestMachine.TestCase.settings = settings(
        max_examples=40, stateful_step_count=20, deadline=None, database=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )


@unittest.skipIf(settings is None, "needs hypothesis (python/requirements-ci.txt)")
class KvIntegerProperties(unittest.TestCase):
    def test_kv_calls_with_integers_at_and_beyond_the_c_limits(self):
        KvRequestMachine.TestCase("runTest").runTest()

    def test_kv_space_counts_beyond_their_c_types_are_refused(self):
        from hypothesis import given

        fields = ("layers", "kv_heads", "head_dim", "max_requests", "max_tokens", "host_bytes",
                  "disk_bytes", "device")

        @settings(max_examples=150, deadline=None, database=None, derandomize=True)
        @given(field=st.sampled_from(fields), value=ints)
        def check(field, value):
            limit = 2**31 if field == "device" else U64 if field.endswith("bytes") else 2**32
            low = -(2**31) if field == "device" else 0
            if low <= value < limit:
                return  # in range: the C side's to judge (issue 31 item 1)
            args = dict(layers=1, kv_heads=1, head_dim=8, max_requests=1, max_tokens=16)
            args[field] = value
            with self.assertRaisesRegex(strata.InvalidArgument, field):
                kv.KvSpace(**args)

        check()


if __name__ == "__main__":
    unittest.main()
