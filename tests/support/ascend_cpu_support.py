"""CPU-side access to the Ascend operator set's plain C++ parts (host tiling and kernel replay).

Compiles ``kernels/ascendc/common/tile_plan.cpp`` and ``kernels/ascendc/replay/attention_replay.cpp``
with g++ into one shared library and wraps their C ABI with ctypes. Nothing here needs CANN, an NPU
or torch_npu.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
ASCENDC = REPO / "kernels" / "ascendc"
SOURCES = [ASCENDC / "common" / "tile_plan.cpp", ASCENDC / "replay" / "attention_replay.cpp"]
HEADERS = [ASCENDC / "common" / "tile_plan.h", ASCENDC / "common" / "tile_plan_core.h"]
CXXFLAGS = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off", "-fno-fast-math",
            "-fPIC", "-shared"]


def compiler() -> str | None:
    return shutil.which("g++")


def build_library(out_dir: Path) -> Path:
    """Compile the host tiling + replay into ``out_dir``; the file name carries a source hash."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("g++ not found")
    digest = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.read_bytes())
    digest.update(" ".join(CXXFLAGS).encode())
    lib = out_dir / f"libonpolicy_ascend_cpu_{digest.hexdigest()[:12]}.so"
    if not lib.exists():
        cmd = [cxx, *CXXFLAGS, f"-I{ASCENDC / 'common'}", *map(str, SOURCES), "-o", str(lib)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return lib


class Consts(ctypes.Structure):
    _fields_ = [("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("kv_tile", ctypes.c_int32), ("row_tile", ctypes.c_int32), ("row_tiles_per_block", ctypes.c_int32),
                ("dtype_bytes", ctypes.c_int32), ("scale", ctypes.c_float)]


class Geometry(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "num_seqs", "num_heads", "num_kv_heads", "group", "head_dim", "kv_tile", "row_tile", "block_rows",
        "kv_layout", "page_size", "max_pages", "workers")] + [
        ("num_tasks", ctypes.c_int64), ("num_kv_tasks", ctypes.c_int64), ("scale", ctypes.c_float),
        ("dtype_bytes", ctypes.c_int32)]


class Task(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "seq", "kv_head", "block", "first_row", "valid_rows", "first_query", "last_query", "first_pos", "last_pos",
        "num_kv_tiles")] + [("q_offset", ctypes.c_int64)]


class KvTask(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "seq", "kv_head", "tile", "valid_kv", "first_block", "num_blocks")] + [("kv_row", ctypes.c_int64)]


class Token(ctypes.Structure):
    _fields_ = [("task", ctypes.c_int64)] + [(name, ctypes.c_int32) for name in (
        "worker", "kv_head", "block", "row_in_block", "block_rows", "kv_tile", "head_dim", "position", "kv_split",
        "tiles_visited", "tiles_effective")]


class MatmulPlan(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "m", "n", "k", "base_m", "base_n", "base_k", "m_tiles", "n_tiles", "k_steps", "split_k", "workers",
        "dtype_bytes")] + [("num_tasks", ctypes.c_int64)]


class RowPlan(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in ("rows", "cols", "chunk", "chunks", "workers", "dtype_bytes")] + [
        ("eps", ctypes.c_float), ("reserved", ctypes.c_int32)]


_F = ctypes.POINTER(ctypes.c_float)
QK_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(Task), ctypes.c_int32, ctypes.c_int64, _F, _F)
PV_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(Task), ctypes.c_int32, ctypes.c_int64, _F, _F)
EXP_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, _F, ctypes.c_int64)
ROWSUM_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, _F, ctypes.c_int32, ctypes.c_int32, _F)


class Hooks(ctypes.Structure):
    _fields_ = [("ctx", ctypes.c_void_p), ("qk", QK_FN), ("pv", PV_FN), ("exp", EXP_FN), ("rowsum", ROWSUM_FN)]


def as_tensor(ptr: ctypes.POINTER(ctypes.c_float), n: int) -> torch.Tensor:
    """Zero-copy fp32 tensor over a C buffer of ``n`` floats."""
    return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n,)))


@dataclass(frozen=True)
class TokenPlan:
    worker: int
    kv_head: int
    block: int
    row_in_block: int
    block_rows: int
    kv_tile: int
    head_dim: int
    position: int
    kv_split: int
    tiles_visited: int
    tiles_effective: int
    tile_kv_rows: tuple[int, ...]
    tile_cols: tuple[int, ...]


class Plan:
    """An attention plan built by the shared host tiling (owned C++ object)."""

    def __init__(self, lib: NativeLib, handle: int, kind: str) -> None:
        self._lib = lib
        self.handle = handle
        self.kind = kind

    def __del__(self) -> None:
        handle, self.handle = getattr(self, "handle", None), None
        if handle:
            self._lib.dll.op_tp_plan_free(handle)

    @property
    def geometry(self) -> Geometry:
        g = Geometry()
        self._lib.dll.op_tp_plan_geometry(self.handle, ctypes.byref(g))
        return g

    def tasks(self) -> list[Task]:
        out = []
        for i in range(self._lib.dll.op_tp_plan_num_tasks(self.handle)):
            t = Task()
            self._lib.check(self._lib.dll.op_tp_plan_task(self.handle, i, ctypes.byref(t)) == 0)
            out.append(t)
        return out

    def kv_tasks(self) -> list[KvTask]:
        out = []
        for i in range(self._lib.dll.op_tp_plan_num_kv_tasks(self.handle)):
            t = KvTask()
            self._lib.check(self._lib.dll.op_tp_plan_kv_task(self.handle, i, ctypes.byref(t)) == 0)
            out.append(t)
        return out

    def token(self, seq: int, query: int, head: int) -> TokenPlan:
        cap = 4096
        tok = Token()
        rows = (ctypes.c_int64 * cap)()
        cols = (ctypes.c_int32 * cap)()
        n = self._lib.dll.op_tp_plan_token(self.handle, seq, query, head, ctypes.byref(tok), rows, cols, cap)
        self._lib.check(n >= 0)
        return TokenPlan(tok.worker, tok.kv_head, tok.block, tok.row_in_block, tok.block_rows, tok.kv_tile,
                         tok.head_dim, tok.position, tok.kv_split, tok.tiles_visited, tok.tiles_effective,
                         tuple(rows[:n]), tuple(cols[:n]))


class NativeLib:
    """ctypes wrapper of the compiled host tiling + replay library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        dll = ctypes.CDLL(str(path))
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        p32, p64 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)
        sig = {
            "op_tp_last_error": (ctypes.c_char_p, []),
            "op_tp_plan_training": (vp, [ctypes.POINTER(Consts), i32, p64, i32]),
            "op_tp_plan_contiguous": (vp, [ctypes.POINTER(Consts), i32, p32, p32, p32, p64, i32]),
            "op_tp_plan_paged": (vp, [ctypes.POINTER(Consts), i32, p32, p32, p32, p32, i32, i32, i32]),
            "op_tp_plan_free": (None, [vp]),
            "op_tp_plan_geometry": (ctypes.c_int, [vp, ctypes.POINTER(Geometry)]),
            "op_tp_plan_num_tasks": (i64, [vp]),
            "op_tp_plan_task": (ctypes.c_int, [vp, i64, ctypes.POINTER(Task)]),
            "op_tp_plan_num_kv_tasks": (i64, [vp]),
            "op_tp_decode_task": (ctypes.c_int, [vp, i64, ctypes.POINTER(Task)]),
            "op_tp_decode_kv_task": (ctypes.c_int, [vp, i64, ctypes.POINTER(KvTask)]),
            "op_tp_plan_kv_task": (ctypes.c_int, [vp, i64, ctypes.POINTER(KvTask)]),
            "op_tp_plan_token": (i32, [vp, i32, i32, i32, ctypes.POINTER(Token), p64, p32, i32]),
            "op_tp_matmul_plan": (ctypes.c_int, [i32, i32, i32, i32, i32, ctypes.POINTER(MatmulPlan)]),
            "op_tp_row_plan": (ctypes.c_int, [i32, i32, i32, i32, ctypes.POINTER(RowPlan)]),
            "op_tp_sizeof_geometry": (i32, []),
            "op_tp_sizeof_task": (i32, []),
            "op_tp_sizeof_kv_task": (i32, []),
            "op_rp_last_error": (ctypes.c_char_p, []),
            "op_rp_attention": (ctypes.c_int, [vp, _F, _F, _F, i64, ctypes.POINTER(Hooks), _F]),
            "op_rp_native_rowsum": (ctypes.c_float, [_F, i32]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(dll, name)
            fn.restype = restype
            fn.argtypes = argtypes
        self.dll = dll

    def check(self, ok: bool, which: str = "op_tp_last_error") -> None:
        if not ok:
            raise RuntimeError(getattr(self.dll, which)().decode())

    @staticmethod
    def consts(*, num_heads: int, num_kv_heads: int, head_dim: int, kv_tile: int, row_tile: int = 8,
               row_tiles_per_block: int = 1, dtype_bytes: int = 4, scale: float = 1.0) -> Consts:
        return Consts(num_heads, num_kv_heads, head_dim, kv_tile, row_tile, row_tiles_per_block, dtype_bytes, scale)

    def plan_training(self, c: Consts, lens: list[int], workers: int = 48) -> Plan:
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        h = self.dll.op_tp_plan_training(ctypes.byref(c), len(lens), cu.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                                         workers)
        self.check(bool(h))
        return Plan(self, h, "training")

    def plan_contiguous(self, c: Consts, q_lens: list[int], q_starts: list[int], kv_lens: list[int],
                        kv_offsets: list[int], workers: int = 48) -> Plan:
        arr = [np.asarray(x, dtype=np.int32) for x in (q_lens, q_starts, kv_lens)]
        off = np.asarray(kv_offsets, dtype=np.int64)
        p32 = ctypes.POINTER(ctypes.c_int32)
        h = self.dll.op_tp_plan_contiguous(ctypes.byref(c), len(q_lens), *(a.ctypes.data_as(p32) for a in arr),
                                           off.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), workers)
        self.check(bool(h))
        return Plan(self, h, "contiguous")

    def plan_paged(self, c: Consts, q_lens: list[int], q_starts: list[int], kv_lens: list[int],
                   block_table: np.ndarray, page_size: int, workers: int = 48) -> Plan:
        arr = [np.asarray(x, dtype=np.int32) for x in (q_lens, q_starts, kv_lens)]
        table = np.ascontiguousarray(block_table, dtype=np.int32)
        p32 = ctypes.POINTER(ctypes.c_int32)
        h = self.dll.op_tp_plan_paged(ctypes.byref(c), len(q_lens), *(a.ctypes.data_as(p32) for a in arr),
                                      table.ctypes.data_as(p32), table.shape[1], page_size, workers)
        self.check(bool(h))
        return Plan(self, h, "paged")

    def matmul_plan(self, m: int, n: int, k: int, dtype_bytes: int, workers: int = 24) -> MatmulPlan:
        out = MatmulPlan()
        self.check(self.dll.op_tp_matmul_plan(m, n, k, dtype_bytes, workers, ctypes.byref(out)) == 0)
        return out

    def row_plan(self, rows: int, cols: int, dtype_bytes: int, workers: int = 48) -> RowPlan:
        out = RowPlan()
        self.check(self.dll.op_tp_row_plan(rows, cols, dtype_bytes, workers, ctypes.byref(out)) == 0)
        return out

    def replay(self, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               hooks: Hooks | None = None) -> torch.Tensor:
        """Run the kernel-order replay. ``q [N, Hq, D]``, ``k``/``v`` ``[rows, Hkv, D]`` (fp32, contiguous)."""
        q, k, v = (t.detach().float().contiguous() for t in (q, k, v))
        out = torch.full_like(q, float("nan"))

        def ptr(t: torch.Tensor) -> ctypes.POINTER(ctypes.c_float):
            return ctypes.cast(t.data_ptr(), _F)

        rc = self.dll.op_rp_attention(plan.handle, ptr(q), ptr(k), ptr(v), k.shape[0],
                                      ctypes.byref(hooks) if hooks is not None else None, ptr(out))
        self.check(rc == 0, "op_rp_last_error")
        return out


def paged_cache(k: torch.Tensor, v: torch.Tensor, lens: list[int], page: int, gen: torch.Generator,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter packed per-sequence K/V into a shuffled paged cache; returns (k_pages, v_pages, table)."""
    pages_per = [-(-n // page) for n in lens]
    total = sum(pages_per) + 1
    perm = torch.randperm(total, generator=gen).tolist()
    kp = torch.randn(total, page, *k.shape[1:], generator=gen).to(k.dtype)  # unused slots hold finite junk
    vp = torch.randn(total, page, *v.shape[1:], generator=gen).to(v.dtype)
    table = torch.full((len(lens), max(pages_per) + 1), perm[-1], dtype=torch.int64)
    used, start = 0, 0
    for s, n in enumerate(lens):
        for p in range(pages_per[s]):
            table[s, p] = perm[used]
            used += 1
        for pos in range(n):
            kp[table[s, pos // page], pos % page] = k[start + pos]
            vp[table[s, pos // page], pos % page] = v[start + pos]
        start += n
    return kp, vp, table
