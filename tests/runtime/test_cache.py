"""The compile cache: what goes into a key, and the disk store (round trip, damage, races).

The store tests use a stand-in for a compiled function (``export_to_c`` writes
known bytes, loading reads them back) so they exercise the cache's logic in
milliseconds; ``test_real_kernel_round_trip_in_a_fresh_process`` does it with a
real GEMM compiled for sm_90a.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import epicute
from epicute.epilogue.fusion import EpilogueFusion
from epicute.gemm import GemmConfig, GemmProblem
from epicute.gemm.compile import GemmVariant
from epicute.gemm.launch import cached_plan, variant_of
from epicute.runtime import cache as cache_mod
from epicute.runtime.cache import CacheKey, KernelCache, clear_disk, disk_entries
from tests.conftest import subprocess_env

REPO = Path(__file__).resolve().parents[2]


def _fusion(fn, kinds: dict, dtypes: dict | None = None) -> EpilogueFusion:
    epi = epicute.epilogue(fn)
    dtypes = dtypes or {}
    graph = epi.trace(kinds, dtypes, {"D": "bf16"}, d_dtype="bf16")
    return EpilogueFusion(graph, tuple((p, kinds[p], dtypes.get(p, "fp32")) for p in epi.params))


BASE = GemmVariant(GemmConfig(tile_n=128), "bf16", "bf16", "k", "n")


# ------------------------------------------------------------------------- keys
def test_equal_variants_have_equal_keys():
    again = GemmVariant(GemmConfig(tile_n=128), "bf16", "bf16", "k", "n")
    assert again.key() == BASE.key() and again.key().digest == BASE.key().digest


@pytest.mark.parametrize(
    "changed",
    [
        replace(BASE, config=GemmConfig(tile_n=256)),
        replace(BASE, config=GemmConfig(tile_n=128, ab_stages=5)),
        replace(BASE, config=GemmConfig(tile_n=128, cluster_m=2)),
        replace(BASE, config=GemmConfig(tile_n=128, persistent=False)),
        replace(BASE, ab_dtype="fp16"),
        replace(BASE, d_dtype="fp32"),
        replace(BASE, a_major="m"),
        replace(BASE, b_major="k"),
        replace(BASE, arch="sm_100a"),
        replace(BASE, fusion=_fusion(lambda acc, bias: acc + bias, {"bias": "row"})),
    ],
    ids=[
        "tile",
        "stages",
        "cluster",
        "persistence",
        "ab-dtype",
        "d-dtype",
        "a-major",
        "b-major",
        "arch",
        "epilogue",
    ],  # fmt: skip
)
def test_each_codegen_change_changes_the_key(changed):
    assert changed.key() != BASE.key()
    assert changed.key().digest != BASE.key().digest


def test_epilogue_constants_kinds_and_dtypes_are_in_the_key_but_not_scalar_values():
    add_row = replace(BASE, fusion=_fusion(lambda acc, bias: acc + bias, {"bias": "row"}))
    key = add_row.key().digest
    assert replace(BASE, fusion=_fusion(lambda acc, b: acc + b, {"b": "col"})).key().digest != key
    bf16_bias = _fusion(lambda acc, bias: acc + bias, {"bias": "row"}, {"bias": "bf16"})
    assert replace(BASE, fusion=bf16_bias).key().digest != key
    assert replace(BASE, fusion=_fusion(lambda acc, bias: acc + bias + 1.0, {"bias": "row"})).key().digest != key
    assert replace(BASE, fusion=_fusion(lambda acc, bias: acc + bias, {"bias": "row"})).key().digest == key
    # alpha is an input of the graph: its value is a kernel argument, never part of the key
    scaled = _fusion(lambda acc, alpha: alpha * acc, {"alpha": "scalar"})
    rescaled = _fusion(lambda acc, alpha: alpha * acc, {"alpha": "scalar"})
    assert replace(BASE, fusion=scaled).key() == replace(BASE, fusion=rescaled).key()


def test_problem_sizes_are_not_in_the_key():
    """Sizes that the planner serves with one config share one compiled kernel."""
    keys = {variant_of(cached_plan(GemmProblem(m, 8192, 8192), ())).key() for m in (8193, 9000, 12288, 20000)}
    assert len(keys) == 1
    # Odd sizes and batch counts too, with the config pinned; one batch is the kernel's 2-D form (an unbatched
    # call hands it its own tensors), shared by every size too. (Left to plan, the L2 hint splits them in two: M of
    # one tile, whose B only that tile reads, and more.)
    pinned = (("cluster_m", 1), ("persistent", False), ("tile_n", 128), ("evict_first", ""))
    batched = variant_of(cached_plan(GemmProblem(17, 136, 72, 3), pinned))
    assert batched.key() == variant_of(cached_plan(GemmProblem(1000, 4104, 136, 2), pinned)).key()
    flat = {variant_of(cached_plan(GemmProblem(m, 4104, 136, 1), pinned)).key() for m in (1, 17, 1000)}
    assert flat == {replace(batched, batched=False).key()}


def test_a_tensor_can_never_leak_into_a_key():
    with pytest.raises(TypeError, match="Tensor"):
        CacheKey("gemm", (1, torch.zeros(1)))
    with pytest.raises(TypeError, match="GemmConfig"):
        CacheKey("gemm", ((GemmConfig(),),))


def test_label_is_not_part_of_the_key():
    assert CacheKey("gemm", (1,), label="a") == CacheKey("gemm", (1,), label="b")
    assert CacheKey("gemm", (1,), label="a").digest == CacheKey("gemm", (1,)).digest


def test_key_text_names_the_code_versions():
    text = BASE.key().text
    for needle in ("kind=gemm", "arch=sm_90a", "cutlass-dsl=4.8.1", "epicute=", "epicute-sources=", "tvm-ffi="):
        assert needle in text


def test_the_sources_fingerprint_changes_with_every_declared_codegen_file(tmp_path):
    """Editing any file a declared family's code is generated from (epicute/families.py) makes every key new;
    editing a file outside them (the CLI) does not."""
    import shutil

    from epicute.runtime.family import PACKAGE_ROOT, codegen_files

    root = tmp_path / PACKAGE_ROOT.name
    shutil.copytree(PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    base = cache_mod.sources_fingerprint(root)
    assert base == cache_mod.sources_fingerprint()  # paths relative to the package: the same wherever installed
    files = codegen_files(root)
    names = {f.relative_to(root).as_posix() for f in files}
    backward = {f"attention/{name}.py" for name in ("backward_sm90", "backward_prep_sm90", "backward_plan", "backward")}
    assert backward | {"attention/combine_sm90.py", "attention/key_blocks.py", "sm90/pipeline.py"} <= names
    for f in files:
        text = f.read_bytes()
        f.write_bytes(text + b"# edited\n")
        assert cache_mod.sources_fingerprint(root) != base, f"editing {f.relative_to(root)} keeps the fingerprint"
        f.write_bytes(text)
    (root / "cli.py").write_text((root / "cli.py").read_text() + "# edited\n")
    assert cache_mod.sources_fingerprint(root) == base


# ------------------------------------------------------------------- disk store
class FakeCompiled:
    """Stands in for a DSL-compiled function: exports known bytes."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def export_to_c(self, path: str, function_name: str) -> None:
        Path(path).write_bytes(self.payload + b"|" + function_name.encode())


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh cache directory; loading an entry returns ("loaded", its bytes)."""
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("EPICUTE_CACHE", raising=False)
    monkeypatch.setattr(cache_mod, "load_exported", lambda path, function: ("loaded", Path(path).read_bytes()))
    monkeypatch.setattr(cache_mod, "link_library", lambda obj, out: False)  # no C compiler: the object file alone
    return tmp_path


def _builder(payload: bytes, calls: list):
    def build():
        calls.append(payload)
        return FakeCompiled(payload)

    return build


def test_round_trip_loads_in_a_new_cache_instead_of_compiling(store):
    key = CacheKey("test", ("round-trip", os.urandom(8).hex()))
    calls: list = []
    first = KernelCache()
    fn = first.get(key, _builder(b"kernel-1", calls))
    assert fn[0] == "loaded" and fn[1].startswith(b"kernel-1|epicute_test_")  # served from what was written
    assert first.get(key, _builder(b"other", calls)) is fn  # memory hit
    assert calls == [b"kernel-1"] and first.stats.compiles == 1

    second = KernelCache()  # a new process, as far as the cache can tell
    assert second.get(key, _builder(b"other", calls))[1] == fn[1]
    assert calls == [b"kernel-1"]
    assert second.stats.disk_loads == 1 and second.stats.compiles == 0
    assert second.events[key][0] == "disk"
    (entry,) = disk_entries(store)
    assert entry["digest"] == key.digest and entry["current"] and entry["kind"] == "test"


def _fake_linker(obj: Path, out: Path) -> bool:
    out.write_bytes(b"library:" + obj.read_bytes())
    return True


def test_a_linked_library_is_loaded_before_the_object_file(store, monkeypatch):
    monkeypatch.setattr(cache_mod, "link_library", _fake_linker)
    monkeypatch.setattr(cache_mod, "load_library", lambda path, function: ("module", ("library", path.read_bytes())))
    key = CacheKey("test", ("library", os.urandom(8).hex()))
    fn = KernelCache().get(key, _builder(b"kernel-lib", []))
    assert fn[0] == "library" and fn[1].startswith(b"library:kernel-lib|epicute_test_")
    (entry,) = disk_entries(store)
    assert entry["library"]["size"] == len(fn[1])
    second = KernelCache()
    assert second.get(key, _builder(b"other", []))[0] == "library" and second.stats.disk_loads == 1
    assert second._libraries[key] == "module"  # kept loaded while the cache lives


@pytest.mark.parametrize("damage", ["missing", "flip", "does-not-load"])
def test_a_library_that_fails_falls_back_to_the_object_file(store, monkeypatch, damage):
    monkeypatch.setattr(cache_mod, "link_library", _fake_linker)
    key = CacheKey("test", ("library-fallback", damage, os.urandom(8).hex()))
    KernelCache().get(key, _builder(b"kernel-fb", []))
    library = store / "kernels" / f"{key.digest}.so"
    if damage == "missing":
        library.unlink()
    elif damage == "flip":
        library.write_bytes(b"X" + library.read_bytes()[1:])

    def refuse(path, function):
        raise RuntimeError("cannot open shared object: libcute_dsl_runtime.so (another machine's run path)")

    monkeypatch.setattr(cache_mod, "load_library", refuse if damage == "does-not-load" else None)
    second = KernelCache()
    fn = second.get(key, _builder(b"other", []))
    assert fn[0] == "loaded" and fn[1].startswith(b"kernel-fb|")  # the object file, not a rebuild
    assert second.stats.compiles == 0 and second.stats.rebuilt_corrupt == 0


def test_link_library_without_a_compiler_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    out = tmp_path / "k.so"
    assert cache_mod.link_library(tmp_path / "k.o", out) is False and not out.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest", "bad-manifest"])
def test_damaged_entry_is_detected_rebuilt_and_reported_once(store, damage):
    key = CacheKey("test", ("damage", damage, os.urandom(8).hex()))
    calls: list = []
    KernelCache().get(key, _builder(b"good-kernel", calls))
    obj, manifest = store / "kernels" / f"{key.digest}.o", store / "kernels" / f"{key.digest}.json"
    if damage == "truncate":
        obj.write_bytes(obj.read_bytes()[:5])
    elif damage == "flip":
        data = bytearray(obj.read_bytes())
        data[0] ^= 0xFF
        obj.write_bytes(bytes(data))
    elif damage == "no-manifest":
        manifest.unlink()
    else:
        manifest.write_text("{not json")

    cache = KernelCache()
    with pytest.warns(RuntimeWarning, match="damaged.*rebuilding"):
        fn = cache.get(key, _builder(b"good-kernel", calls))
    assert fn[1].startswith(b"good-kernel|")
    assert calls == [b"good-kernel", b"good-kernel"] and cache.stats.rebuilt_corrupt == 1
    # Rebuilt: a third process loads it cleanly, with no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = KernelCache()
        third.get(key, _builder(b"unused", calls))
    assert third.stats.disk_loads == 1 and len(calls) == 2


def test_cache_off_writes_nothing(store, monkeypatch):
    monkeypatch.setenv("EPICUTE_CACHE", "0")
    calls: list = []
    cache = KernelCache()
    fn = cache.get(CacheKey("test", ("off",)), _builder(b"x", calls))
    assert isinstance(fn, FakeCompiled) and calls == [b"x"]
    assert not (store / "kernels").exists()
    assert cache_mod.cache_dir() is None


def test_clear_removes_entries_and_stale_only_keeps_current(store):
    calls: list = []
    cache = KernelCache()
    for i in range(3):
        cache.get(CacheKey("test", ("clear", i)), _builder(b"k%d" % i, calls))
    stale = store / "kernels" / f"{CacheKey('test', ('clear', 0)).digest}.json"
    stale.write_text(stale.read_text().replace('"cutlass-dsl": "4.8.1"', '"cutlass-dsl": "0.0"'))
    assert sum(not e["current"] for e in disk_entries(store)) == 1
    assert clear_disk(store, stale_only=True) == 1
    assert len(disk_entries(store)) == 2
    assert clear_disk(store) == 2
    assert disk_entries(store) == [] and list((store / "kernels").iterdir()) == []


def test_verify_reports_missing_and_corrupt_objects(store):
    keys = [CacheKey("test", ("verify", i, os.urandom(8).hex())) for i in range(4)]
    for key in keys:
        KernelCache().get(key, _builder(b"kernel", []))
    kernels = store / "kernels"
    (kernels / f"{keys[1].digest}.o").unlink()
    (kernels / f"{keys[2].digest}.o").write_bytes(b"kernel|truncated")
    (kernels / f"{keys[3].digest}.json").write_text("[]")
    unverified = {e["digest"]: e["damaged"] for e in disk_entries(store)}
    assert unverified == {**{key.digest: "" for key in keys[:3]}, keys[3].digest: "unreadable manifest"}
    verified = {e["digest"]: e["damaged"] for e in disk_entries(store, verify=True)}
    assert verified[keys[0].digest] == "" and verified[keys[1].digest] == "object file missing"
    assert verified[keys[2].digest] == "object file is 16 bytes and fails its checksum"
    assert verified[keys[3].digest] == "unreadable manifest"


def test_check_cache_dir_names_the_setting_and_the_fix(tmp_path, monkeypatch):
    from epicute.errors import ConfigError

    monkeypatch.delenv("EPICUTE_CACHE", raising=False)
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path / "new" / "cache"))
    assert cache_mod.check_cache_dir() == tmp_path / "new" / "cache"  # creatable is usable
    assert not (tmp_path / "new").exists()
    assert cache_mod.check_cache_dir(create=True) == tmp_path / "new" / "cache"
    assert (tmp_path / "new" / "cache" / "kernels").is_dir()
    (tmp_path / "afile").write_text("")
    for root in (tmp_path / "afile", tmp_path / "afile" / "below"):
        monkeypatch.setenv("EPICUTE_CACHE_DIR", str(root))
        message = r"set by EPICUTE_CACHE_DIR\) is unusable: .*afile is a file, not a directory; set EPICUTE_CACHE_DIR"
        with pytest.raises(ConfigError, match=message):
            cache_mod.check_cache_dir()
    (tmp_path / "kernels-file" / "kernels").parent.mkdir()
    (tmp_path / "kernels-file" / "kernels").write_text("")
    with pytest.raises(ConfigError, match="kernels is a file"):
        cache_mod.check_cache_dir(tmp_path / "kernels-file")
    monkeypatch.setenv("EPICUTE_CACHE", "0")
    assert cache_mod.check_cache_dir() is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_check_cache_dir_wants_write_access_only_to_write(tmp_path):
    from epicute.errors import ConfigError

    (tmp_path / "ro" / "kernels").mkdir(parents=True)
    (tmp_path / "ro").chmod(0o555)
    (tmp_path / "ro" / "kernels").chmod(0o555)
    try:
        assert cache_mod.check_cache_dir(tmp_path / "ro") == tmp_path / "ro"  # a read-only copy still lists and loads
        with pytest.raises(ConfigError, match="is not writable"):
            cache_mod.check_cache_dir(tmp_path / "ro", writable=True)
    finally:
        (tmp_path / "ro" / "kernels").chmod(0o755)
        (tmp_path / "ro").chmod(0o755)


RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from epicute.runtime import cache as cache_mod

    log = Path(sys.argv[1])
    cache_mod.load_exported = lambda path, function: Path(path).read_bytes()

    class Compiled:
        def export_to_c(self, path, function_name):
            Path(path).write_bytes(b"raced-kernel")

    def build():
        with open(log, "a") as f:
            f.write("compile\\n")
        # Compile until the other process has asked for the same key too (no sleep: a loaded machine may
        # take any time to start it), so its request meets this compile in flight; the deadline only keeps a
        # broken run from hanging (nothing is timed).
        deadline = time.time() + 240
        while log.read_text().count("enter") < 2 and time.time() < deadline:
            time.sleep(0.01)
        with open(log, "a") as f:
            f.write("compiled\\n")
        return Compiled()

    key = cache_mod.CacheKey("test", ("race", sys.argv[2]))
    key.text  # computed before "enter": the versions import the DSL (slow, and not the race)
    with open(log, "a") as f:
        f.write("enter\\n")
    fn = cache_mod.KernelCache().get(key, build)
    assert fn == b"raced-kernel", fn
    print("ok")
    """
)


def test_two_processes_racing_on_one_key_compile_once(tmp_path):
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    log = tmp_path / "compiles.log"
    env = subprocess_env(EPICUTE_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("EPICUTE_CACHE", None)
    tag = os.urandom(8).hex()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(log), tag],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == "ok"
    events = [line.split() for line in log.read_text().splitlines()]
    assert [e[0] for e in events].count("compile") == 1
    names = [e[0] for e in events]  # in the order the processes appended them
    # Both processes asked while the one compile was running: the second waited, then loaded.
    assert all(i < names.index("compiled") for i, name in enumerate(names) if name == "enter")


# ----------------------------------------------------- real kernels (no GPU needed)
FRESH_LOAD = textwrap.dedent(
    """
    import sys, torch
    from epicute.gemm import GemmProblem
    from epicute.runtime.cache import KERNEL_CACHE
    from epicute.gemm.compile import GEMM_CACHE
    from epicute.gemm.launch import cached_plan, variant_of

    fn = GEMM_CACHE.get(variant_of(cached_plan(GemmProblem(17, 136, 72, 3), ())))
    print("compiles", KERNEL_CACHE.stats.compiles, "disk_loads", KERNEL_CACHE.stats.disk_loads)
    t = torch.zeros(1, 8, 8, dtype=torch.bfloat16)
    try:
        fn(t, t, t, (), (), (), (), 132)  # CPU tensors: the loaded kernel's own argument check answers
    except ValueError as exc:
        print("signature:", exc)
    """
)


@pytest.mark.compile
def test_real_kernel_round_trip_in_a_fresh_process(tmp_path):
    """Compile a GEMM here into a cache dir; a new process loads it (and never compiles)."""
    env = subprocess_env(EPICUTE_CACHE_DIR=str(tmp_path))
    env.pop("EPICUTE_CACHE", None)
    script = tmp_path / "load.py"
    script.write_text(FRESH_LOAD)
    first = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert first.returncode == 0, first.stderr
    assert "compiles 1 disk_loads 0" in first.stdout
    second = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert second.returncode == 0, second.stderr
    assert "compiles 0 disk_loads 1" in second.stdout
    assert "mA_lmk" in second.stdout and "expected device_type=cuda" in second.stdout


def test_kernel_families_key_each_variant_once(monkeypatch):
    # A kernel lookup keys its variant once (a key checks and formats its parts, costlier than the launch);
    # equal variants share the key, an unhashable one is keyed on every lookup.
    from dataclasses import dataclass

    from epicute.runtime import compile as compile_mod

    monkeypatch.setattr(compile_mod, "FAMILIES", {})
    keyed = []

    @dataclass(frozen=True)
    class Variant:
        n: int
        arch: str = "sm_90a"

        def key(self):
            keyed.append(self.n)
            return CacheKey("remembered_keys_test", (self.n,), self.arch)

    family = compile_mod.KernelFamily("remembered_keys_test", {"sm_90a": lambda v: v.n})
    assert family.key(Variant(1)) == family.key(Variant(1)) == CacheKey("remembered_keys_test", (1,))
    assert family.key(Variant(2)).parts == (2,)
    assert keyed == [1, 2]

    @dataclass(eq=True)  # eq without frozen: unhashable
    class Loose:
        n: int
        arch: str = "sm_90a"
        key = Variant.key

    family.key(Loose(3))
    family.key(Loose(3))
    assert keyed == [1, 2, 3, 3]
    monkeypatch.setattr(compile_mod.KernelFamily, "REMEMBERED_KEYS", 2)
    family.key(Variant(4))  # a third variant: the family forgets the first two
    family.key(Variant(1))
    assert keyed == [1, 2, 3, 3, 4, 1]


def test_a_family_finds_a_repeat_variants_kernel_by_identity(monkeypatch):
    """The same variant object again gets its kernel without its key (the cache asked once); an equal but other
    object, an unhashable variant, forgotten or replaced memory go to the cache again."""
    from dataclasses import dataclass

    from epicute.runtime import compile as compile_mod

    monkeypatch.setattr(compile_mod, "KERNEL_CACHE", KernelCache())
    monkeypatch.setenv("EPICUTE_CACHE", "0")
    built = []

    @dataclass(frozen=True)
    class Variant:
        n: int
        arch: str = "sm_90a"

        def key(self):
            return CacheKey("identity_test", (self.n,), self.arch)

    family = compile_mod.KernelFamily("identity_test", {"sm_90a": lambda v: built.append(v.n) or (lambda: v.n)})
    lookups = []
    real_get = compile_mod.KERNEL_CACHE.get
    monkeypatch.setattr(compile_mod.KERNEL_CACHE, "get", lambda *a: lookups.append(a[0]) or real_get(*a))
    one = Variant(1)
    first = family.get(one)
    assert family.get(one) is first and len(lookups) == 1  # by identity: no key, no cache lookup
    assert family.get(Variant(1)) is first and len(lookups) == 2  # an equal object: the cache's memory
    compile_mod.KERNEL_CACHE.clear_memory()
    again = family.get(one)
    assert again is not first and again() == 1 and built == [1, 1] and len(lookups) == 3  # forgotten: compiled anew

    @dataclass(eq=True)  # eq without frozen: unhashable, so mutable under one id
    class Loose:
        n: int
        arch: str = "sm_90a"
        key = Variant.key

    loose = Loose(2)
    family.get(loose)
    loose.n = 3
    assert family.get(loose)() == 3 and built == [1, 1, 2, 3]
